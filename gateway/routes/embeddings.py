"""OpenAI-compatible embeddings, for tenant keys: the surface's POST, a plain route at the
app's top level (`request_path.SurfaceEndpoint`)."""

from __future__ import annotations

from gateway.request_path import surface_route
from gateway.surfaces import EMBEDDINGS

routes = [surface_route("/v1/embeddings", EMBEDDINGS)]
