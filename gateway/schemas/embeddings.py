"""POST /v1/embeddings in OpenAI's shape: the request, checked strictly, and the response.

`input` is one text, a list of texts, one list of token ids, or a list of such lists: at most
2048 inputs, none of them empty (OpenAI refuses an empty string too). Fields outside the schema
are kept as sent (`extra_fields`), so a deployment either forwards them (an upstream that lists
them in `passthrough_fields`) or refuses them by name; none is dropped silently.

Vectors go out as JSON floats or, with `encoding_format: "base64"`, as the base64 of their
little-endian float32 bytes, as OpenAI sends them (the official client asks for base64 by
default and decodes it itself).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from gateway.errors import APIError, bad_request

MAX_INPUTS = 2048
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
EncodingFormat = Literal["float", "base64"]
Inputs = list[str] | list[list[int]]


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: Annotated[str, Field(min_length=1, max_length=512)]
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: EncodingFormat = "float"
    dimensions: Annotated[int, Field(ge=1, le=65_536)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    _dumped: dict[str, Any] | None = PrivateAttr(default=None)

    def inputs(self) -> Inputs:
        """Every input as a list: texts, or token id lists."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if value and isinstance(value[0], int):
            return [value]  # type: ignore[list-item]  # one list of token ids
        return value  # type: ignore[return-value]

    def extra_fields(self) -> list[str]:
        """Top-level fields outside the schema, as sent."""
        return sorted(self.model_extra or {})

    def upstream_body(self) -> dict[str, Any]:
        """The fields the caller set, with their own spellings; a fresh top-level dict."""
        if self._dumped is None:
            self._dumped = self.model_dump(exclude_none=True, exclude_unset=True)
        return dict(self._dumped)


def check_inputs(inputs: Inputs) -> None:
    """A 400 for what the types allow but OpenAI refuses: no input, too many, an empty one."""
    if not inputs:
        raise bad_request("'input' must not be an empty list.", param="input",
                          code="invalid_value")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"'input' holds {len(inputs)} inputs; at most {MAX_INPUTS} are "
                          "allowed per request.", param="input", code="invalid_value")
    for index, item in enumerate(inputs):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty list of tokens"
            where = "'input'" if len(inputs) == 1 else f"'input[{index}]'"
            raise bad_request(f"{where} is {what}; every input must hold text or tokens.",
                              param="input", code="invalid_value")


def unknown_field(name: str) -> APIError:
    return bad_request(f"Unrecognized request argument supplied: {name}", param=name,
                       code="unknown_parameter")


def encode_vector(vector: np.ndarray, encoding_format: EncodingFormat) -> list[float] | str:
    """One vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    vector = np.asarray(vector, dtype="<f4")
    if encoding_format == "base64":
        return base64.b64encode(vector.tobytes()).decode("ascii")
    return vector.tolist()


def as_format(embedding: Any, encoding_format: EncodingFormat) -> list[float] | str:
    """An upstream's embedding (floats or base64) in the format the caller asked for."""
    if isinstance(embedding, str):
        if encoding_format == "base64":
            return embedding
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4").tolist()
    if not isinstance(embedding, list):
        raise ValueError("an embedding is neither a list of floats nor base64")
    return encode_vector(np.asarray(embedding, dtype=np.float32), encoding_format)


def render_embeddings(embeddings: Sequence[list[float] | str], *, model: str,
                      prompt_tokens: int) -> bytes:
    """The response body: `{"object": "list", "data": [...], "model", "usage"}`."""
    data = [{"object": "embedding", "index": index, "embedding": embedding}
            for index, embedding in enumerate(embeddings)]
    body = {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
    return json.dumps(body, separators=(",", ":")).encode()
