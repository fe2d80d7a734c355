"""The engine core's parts: requests, blocks, scheduling, preparing requests and shaping their
outputs. Plain Python, no torch (`workers/llm_engine.py` steps them over a runner).

Only `workers.runner` touches torch; this package can be tested on any machine in milliseconds.
"""
