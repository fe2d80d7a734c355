"""The HTTP front door: OpenAI-compatible API, admin API, auth, limits, routing, dispatch."""
