"""Adapter API shapes. Tenants upload files; only admins may name a folder on the server."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

# Checked again (and fully) by `tenancy.adapters`; these bounds keep junk out of the database.
AdapterName = Annotated[str, Field(min_length=1, max_length=200, pattern=r"^[^\x00:/]*$")]
# An adapter name in a URL path: anything else names no adapter (400, no query).
AdapterKey = Annotated[str, StringConstraints(min_length=1, max_length=200,
                                              pattern=r"^[A-Za-z0-9._-]+$")]
BaseModelName = Annotated[str, Field(min_length=1, max_length=512, pattern=r"^[^\x00:]*$")]
Residency = Literal["device", "cpu", "disk", "unloaded"]


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class AdapterCreate(_In):
    """Admin only: register the peft folder at `path` on the server."""

    name: AdapterName
    base_model: BaseModelName
    path: Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]
    alias: AdapterName | None = None
    pinned: bool = False


class AdapterUpload(_In):
    """Multipart: the two files `save_pretrained` writes, and no server path (extra fields,
    `path` among them, are refused)."""

    name: AdapterName
    base_model: BaseModelName
    alias: AdapterName | None = None
    adapter_config: UploadFile  # adapter_config.json
    adapter_model: UploadFile  # adapter_model.safetensors


class AdminAdapterUpload(AdapterUpload):
    pinned: bool = False  # device slots are shared by every tenant: an operator's decision


class AdapterOut(BaseModel):
    name: str
    model: str  # what to send as "model": "<base_model>:<name>"
    base_model: str
    alias: str | None
    pinned: bool
    uploaded: bool
    created_at: datetime
    residency: Residency  # the engine tier, or "unloaded" when not registered


class AdminAdapterOut(AdapterOut):
    id: str
    tenant_id: str
    path: str  # a server folder: shown to admins only
