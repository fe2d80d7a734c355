"""Responses kept for the OpenAI Responses API (`store`, the default): per tenant, so that
`GET` / `DELETE /v1/responses/{id}` and `previous_response_id` find them, and another tenant
never does (every lookup is by id *and* tenant).

A row holds the response as it was answered, its own input items, and the conversation before
them (the items of the responses it continued, flattened), so a continuation needs one read and
keeps working after a response earlier in the chain is deleted.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, ForeignKey, Index, String, delete, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Mapped, mapped_column

from tenancy.db import Base
from tenancy.models import UTCDateTime, utcnow

RESPONSE_ID_LENGTH = 64


class StoredResponse(Base):
    __tablename__ = "responses"
    __table_args__ = (Index("ix_responses_tenant_id_created_at", "tenant_id", "created_at"),)

    id: Mapped[str] = mapped_column(String(RESPONSE_ID_LENGTH), primary_key=True)  # resp_...
    tenant_id: Mapped[str] = mapped_column(
        String(32), ForeignKey("tenants.id", ondelete="CASCADE"))
    status: Mapped[str] = mapped_column(String(16))  # completed, incomplete
    previous_response_id: Mapped[str | None] = mapped_column(String(RESPONSE_ID_LENGTH))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)  # the Response object, as answered
    input_items: Mapped[list[Any]] = mapped_column(JSON)  # this response's own input
    history: Mapped[list[Any]] = mapped_column(JSON)  # the items before them
    created_at: Mapped[datetime] = mapped_column(UTCDateTime(), default=utcnow)


async def save(session: AsyncSession, *, response_id: str, tenant_id: str, status: str,
               previous_response_id: str | None, body: dict[str, Any],
               input_items: list[Any], history: list[Any]) -> None:
    session.add(StoredResponse(id=response_id, tenant_id=tenant_id, status=status,
                               previous_response_id=previous_response_id, body=body,
                               input_items=input_items, history=history))
    await session.commit()


async def find(session: AsyncSession, *, response_id: str, tenant_id: str
               ) -> StoredResponse | None:
    """The tenant's response with this id (None: no such response, or another tenant's)."""
    return (await session.execute(select(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id))
    ).scalar_one_or_none()


async def remove(session: AsyncSession, *, response_id: str, tenant_id: str) -> bool:
    """Delete the tenant's response; False if it had none by that id."""
    result = await session.execute(delete(StoredResponse).where(
        StoredResponse.id == response_id, StoredResponse.tenant_id == tenant_id))
    await session.commit()
    return bool(getattr(result, "rowcount", 0))
