"""Exact and semantic response caches, per tenant (docs/caching.md).

Nothing here imports the gateway, and nothing does I/O at import or construction.
"""
