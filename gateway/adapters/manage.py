"""Register, load, unload and delete a tenant's adapters: what the admin and tenant routers
share.

Registration loads the files into every engine that serves the base model BEFORE the row is
committed, so whatever the engine refuses (corrupt files, DoRA, rank over the limit, another
base model) is a 400 that leaves nothing behind: no row, no registration, no uploaded files.
Loading and unloading act on this replica's engines; other replicas register lazily.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy.ext.asyncio import AsyncSession

from gateway.adapters.uploads import CONFIG_FILE, WEIGHTS_FILE, remove_upload, save_upload
from gateway.deployments import AdapterRef, Deployment, engine_adapter_name
from gateway.deployments.registry import AUTO
from gateway.errors import APIError, bad_request, conflict
from gateway.state import GatewayState
from tenancy import adapters as rows
from tenancy.models import Adapter, new_id
from workers.engine.sampling_params import InvalidRequestError
from workers.lora.manager import AdapterBusyError

logger = logging.getLogger(__name__)
TIER_ORDER = ("device", "cpu", "disk")  # best first; not registered anywhere is "unloaded"


def serving(state: GatewayState, base_model: str) -> list[Deployment]:
    """The deployments of `base_model` that can apply adapters."""
    return [d for d in state.deployments.route(base_model).deployments if d.serves_adapters]


def adapter_ref(adapter: Adapter) -> AdapterRef:
    return AdapterRef(adapter.id, engine_adapter_name(adapter.tenant_id, adapter.name),
                      adapter.path, adapter.pinned)


async def register_path(
    state: GatewayState, session: AsyncSession, *, tenant_id: str, name: str, base_model: str,
    path: str, alias: str | None = None, pinned: bool = False,
) -> Adapter:
    """Admin only: register a folder already on the server."""
    name, alias = await _check_new(state, session, tenant_id=tenant_id, name=name,
                                   base_model=base_model, alias=alias, path=path)
    return await _register(state, session, tenant_id=tenant_id, name=name, base_model=base_model,
                           path=path, alias=alias, pinned=pinned, uploaded=False, shown=path)


async def register_upload(
    state: GatewayState, session: AsyncSession, *, tenant_id: str, name: str, base_model: str,
    config_file: BinaryIO, weights_file: BinaryIO, alias: str | None = None,
    pinned: bool = False,
) -> Adapter:
    """Store the two peft files, then register them; on any failure the files go again."""
    name, alias = await _check_new(state, session, tenant_id=tenant_id, name=name,
                                   base_model=base_model, alias=alias)
    folder = await save_upload(state.settings.adapter_dir, tenant_id,
                               {CONFIG_FILE: config_file, WEIGHTS_FILE: weights_file})
    try:
        return await _register(state, session, tenant_id=tenant_id, name=name,
                               base_model=base_model, path=str(folder), alias=alias,
                               pinned=pinned, uploaded=True, shown=None)
    except BaseException:
        await remove_upload(state.settings.adapter_dir, folder)
        raise


async def load(state: GatewayState, session: AsyncSession, adapter: Adapter, *,
               pinned: bool | None = None, show_path: bool) -> Adapter:
    """Register with this replica's engines now (and pin or unpin, which is remembered)."""
    deployments = _require_serving(state, adapter.base_model)
    if pinned is not None and pinned != adapter.pinned:
        if adapter.pinned:  # the engine cannot unpin in place: unload, then load unpinned
            await unload(state, adapter)
        updated = await rows.set_adapter_pinned(session, tenant_id=adapter.tenant_id,
                                                name=adapter.name, pinned=pinned)
        adapter = updated or adapter
        await state.watcher.catch_up()
    ref = adapter_ref(adapter)
    try:
        for deployment in deployments:
            await deployment.load_adapter(ref, force=True)
    except (InvalidRequestError, AdapterBusyError) as exc:
        raise _engine_error(exc, ref, adapter.name, adapter.path if show_path else None
                            ) from None
    return adapter


async def unload(state: GatewayState, adapter: Adapter, *, wait_s: float = 0.0) -> None:
    """Unregister from this replica's engines; 409 `adapter_busy` while requests use it."""
    name = engine_adapter_name(adapter.tenant_id, adapter.name)
    for deployment in serving(state, adapter.base_model):
        try:
            await deployment.unload_adapter(name, wait_s=wait_s)
        except AdapterBusyError:
            raise APIError(409, f"The adapter '{adapter.name}' still has requests in flight; "
                           "retry when they are done, or pass wait_s.",
                           code="adapter_busy") from None


async def delete(state: GatewayState, session: AsyncSession, adapter: Adapter, *,
                 wait_s: float = 0.0) -> Adapter:
    """Unload (409 if busy), delete the row, then the files if they were uploaded."""
    await unload(state, adapter, wait_s=wait_s)
    deleted = await rows.delete_adapter(session, tenant_id=adapter.tenant_id, name=adapter.name)
    await state.watcher.catch_up()  # this replica stops resolving it now
    await _unload_quietly(serving(state, adapter.base_model), adapter_ref(adapter))  # a racer's
    if deleted is not None and deleted.uploaded:
        await remove_upload(state.settings.adapter_dir, deleted.path)
    return deleted or adapter


async def residencies(state: GatewayState, adapters: Sequence[Adapter]) -> dict[str, str]:
    """Adapter id -> the best tier it has in this replica's engines, or "unloaded"."""
    tiers: dict[str, dict[str, str]] = {}
    for deployment in state.deployments.deployments():
        if deployment.serves_adapters:
            tiers[deployment.name] = await deployment.adapter_tiers()
    out = {}
    for adapter in adapters:
        name = engine_adapter_name(adapter.tenant_id, adapter.name)
        found = {tiers.get(d.name, {}).get(name) for d in serving(state, adapter.base_model)}
        out[adapter.id] = next((t for t in TIER_ORDER if t in found), "unloaded")
    return out


def describe(adapter: Adapter, residency: str) -> dict[str, Any]:
    """Every field the admin and tenant views pick from."""
    return {
        "id": adapter.id, "tenant_id": adapter.tenant_id, "name": adapter.name,
        "model": f"{adapter.base_model}:{adapter.name}", "base_model": adapter.base_model,
        "alias": adapter.alias, "pinned": adapter.pinned, "uploaded": adapter.uploaded,
        "created_at": adapter.created_at, "path": adapter.path, "residency": residency,
    }


async def _check_new(state: GatewayState, session: AsyncSession, *, tenant_id: str, name: str,
                     base_model: str, alias: str | None, path: str | None = None,
                     ) -> tuple[str, str | None]:
    """Everything that can be refused before any file is written or read; the checked name
    and alias."""
    name = rows.check_adapter_name(name)
    alias = rows.check_alias(alias)
    rows.check_base_model(base_model)
    if path is not None:
        rows.check_path(path)
    _require_serving(state, base_model)
    if alias is not None and (state.deployments.route(alias).deployments or alias == AUTO):
        raise bad_request(f"'{alias}' is the name of a model; pick another alias.",
                          param="alias")
    await rows.check_adapter_free(session, tenant_id=tenant_id, name=name, alias=alias)
    return name, alias


def _require_serving(state: GatewayState, base_model: str) -> list[Deployment]:
    deployments = serving(state, base_model)
    if not deployments:
        raise bad_request(f"No deployment of '{base_model}' serves adapters (it must be a "
                          "model of the embedded engine with LoRA enabled).", param="base_model")
    return deployments


async def _register(
    state: GatewayState, session: AsyncSession, *, tenant_id: str, name: str, base_model: str,
    path: str, alias: str | None, pinned: bool, uploaded: bool, shown: str | None,
) -> Adapter:
    """Load into the engines under a fresh id, then commit the row; undo the loads on failure.

    `name` and `alias` come checked (`_check_new`)."""
    adapter_id = new_id()
    ref = AdapterRef(adapter_id, engine_adapter_name(tenant_id, name), path, pinned)
    loaded: list[Deployment] = []
    try:
        for deployment in serving(state, base_model):
            await deployment.load_adapter(ref)
            loaded.append(deployment)
        adapter = await rows.create_adapter(
            session, tenant_id=tenant_id, name=name, base_model=base_model, path=path,
            alias=alias, pinned=pinned, uploaded=uploaded, adapter_id=adapter_id)
    except (InvalidRequestError, AdapterBusyError) as exc:
        await _unload_quietly(loaded, ref)
        raise _engine_error(exc, ref, name, shown) from None
    except BaseException:
        await _unload_quietly(loaded, ref)
        raise
    await state.watcher.catch_up()
    return adapter


async def _unload_quietly(deployments: Sequence[Deployment], ref: AdapterRef) -> None:
    for deployment in deployments:
        try:
            await deployment.unload_adapter(ref.engine_name)
        except AdapterBusyError as exc:  # stays registered, unreachable without a row
            logger.warning("adapter %s left registered on %s: %s", ref.engine_name,
                           deployment.name, exc)


def _engine_error(exc: Exception, ref: AdapterRef, name: str, shown_path: str | None
                  ) -> APIError:
    """The engine's reason, naming the adapter as the caller knows it and no server folder
    the caller did not name itself."""
    if isinstance(exc, AdapterBusyError):
        return conflict(f"The adapter '{name}' is busy; retry later.")
    message = str(exc).replace(ref.engine_name, name)
    if shown_path is None:
        message = message.replace(str(Path(ref.path)), "the uploaded files")
    return bad_request(f"The adapter was refused: {message}", code="invalid_adapter")
