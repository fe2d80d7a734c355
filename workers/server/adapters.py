"""Hot adapter load, unload and list (vLLM's `/v1/load_lora_adapter` shape, plus tags).

The gateway names adapters (tenant-scoped engine names) and tags each registration with its
adapter id, so a name deleted and registered again elsewhere is replaced here, never reused.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from workers.engine.sampling_params import InvalidRequestError
from workers.lora.manager import AdapterBusyError
from workers.server.http import error, json_body
from workers.server.state import WorkerState

logger = logging.getLogger(__name__)
MAX_UNLOAD_WAIT_S = 60.0


async def list_adapters(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    adapters = await state.adapters()
    return JSONResponse({"object": "list", "data": [
        {"lora_name": name, **info} for name, info in sorted(adapters.items())
    ]})


async def load_adapter(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    try:
        body = await json_body(request)
        name = _string(body, "lora_name")
        path = _string(body, "lora_path")
        tag = body.get("adapter_id")
        if tag is not None and not isinstance(tag, str):
            raise InvalidRequestError("'adapter_id' must be a string", param="adapter_id")
        pinned = bool(body.get("pinned", False))
        if not state.serves_adapters:
            return error(400, "this worker serves no adapters (started with --no-enable-lora)",
                         code="lora_disabled")
        if name == state.options.model_name:
            raise InvalidRequestError("'lora_name' must differ from the base model's name",
                                      param="lora_name")
        async with state.adapter_locks.setdefault(name, asyncio.Lock()):
            registered = await state.adapters()
            current = registered.get(name)
            if current is not None and state.adapter_ids.get(name) != tag:
                await state.engine.remove_lora(name, wait_s=float(body.get("wait_s") or 0.0))
            await state.engine.add_lora(name, path, pinned=pinned)
            state.adapter_ids[name] = tag
        return JSONResponse({"lora_name": name, "adapter_id": tag, "loaded": True})
    except InvalidRequestError as exc:
        return error(400, str(exc), code=exc.code or "invalid_adapter", param=exc.param)
    except AdapterBusyError as exc:
        return error(409, str(exc), code="adapter_busy")
    except OSError as exc:
        logger.warning("adapter %s could not be read: %s", body.get("lora_name"), exc)
        return error(400, f"the adapter files could not be read: {exc.strerror or exc}",
                     code="invalid_adapter", param="lora_path")


async def unload_adapter(request: Request) -> Response:
    state: WorkerState = request.app.state.worker
    try:
        body = await json_body(request)
        name = _string(body, "lora_name")
        wait_s = body.get("wait_s", 0.0)
        if isinstance(wait_s, bool) or not isinstance(wait_s, int | float) or not (
                0 <= wait_s <= MAX_UNLOAD_WAIT_S):
            raise InvalidRequestError(f"'wait_s' must be a number from 0 to {MAX_UNLOAD_WAIT_S:g}",
                                      param="wait_s")
        async with state.adapter_locks.setdefault(name, asyncio.Lock()):
            if name not in await state.adapters():
                return error(404, f"adapter {name!r} is not loaded", code="model_not_found",
                             param="lora_name")
            await state.engine.remove_lora(name, wait_s=float(wait_s))
            state.adapter_ids.pop(name, None)
        state.adapter_locks.pop(name, None)
        return JSONResponse({"lora_name": name, "unloaded": True})
    except InvalidRequestError as exc:
        return error(400, str(exc), code=exc.code, param=exc.param)
    except AdapterBusyError as exc:
        return error(409, str(exc), code="adapter_busy")


def _string(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"'{name}' must be a non-empty string", param=name)
    return value
