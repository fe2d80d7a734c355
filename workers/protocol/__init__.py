"""What crosses the boundary between the gateway and any deployment, on both sides of it.

`requests`: OpenAI's request bodies, checked strictly (the gateway and the worker server
validate with the same models). `events`: an answer as typed events. `render`: the one place
that turns events into OpenAI JSON or SSE and back. None of it imports torch.
"""
