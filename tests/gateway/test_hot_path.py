"""The hot path: no database query per request once a key is cached."""

from __future__ import annotations

import asyncio

from sqlalchemy import event

from gateway.app import create_app
from tests.gateway.support import (
    bearer,
    in_process,
    mock_settings,
    seed_tenant,
)


async def test_cached_key_needs_no_query(db_url, tmp_path, mock_upstream):
    t = await seed_tenant(db_url, tmp_path, name="hot", plan={"rpm": 10_000})
    cfg = mock_settings(db_url, tmp_path, mock_upstream.base_url, auth_poll_interval_s=60,
                        usage_flush_interval_s=60)
    app = create_app(cfg)
    statements: list[str] = []
    async with in_process(app) as gw:
        engine = app.state.gateway.db.sync_engine
        event.listen(engine, "before_cursor_execute",
                     lambda conn, cursor, sql, *args: statements.append(sql))
        body = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}]}
        results = await asyncio.gather(*[
            gw.post("/v1/chat/completions", json=body, headers=bearer(t.key))
            for _ in range(40)])
        assert all(r.status_code == 200 for r in results)
        lookups = [s for s in statements if "api_keys" in s]
        # Forty concurrent requests share one lookup; usage is written later, in a batch.
        assert len(lookups) == 1
        assert not [s for s in statements if "usage_records" in s]
        await app.state.gateway.meter.flush()
        assert len([s for s in statements if "INSERT INTO usage_records" in s]) == 1
