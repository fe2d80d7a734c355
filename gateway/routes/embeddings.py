"""OpenAI-compatible embeddings, for tenant keys."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.request_path import serve
from gateway.surfaces import EMBEDDINGS

router = APIRouter(prefix="/v1", tags=["openai"])


@router.post("/embeddings")
async def embeddings(request: Request) -> Response:
    return await serve(request, EMBEDDINGS)
