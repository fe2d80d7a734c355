"""The engine core: requests, blocks, scheduling, detokenizing. Plain Python, no torch.

Only `workers.runner` touches torch; this package can be tested on any machine in milliseconds.
"""
