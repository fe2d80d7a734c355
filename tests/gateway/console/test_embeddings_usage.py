"""The console's usage page shows embeddings beside completions: their model, their tokens."""

from __future__ import annotations

import asyncio
import re

from tests.gateway.console.support import console
from tests.gateway.support import bearer, seed_tenant

MINILM = "all-minilm-l6-v2"


async def test_usage_page_shows_embeddings(sqlite_url, tmp_path):
    seeded = await seed_tenant(sqlite_url, tmp_path, name="acme")
    async with console(sqlite_url, tmp_path, embedding_model="default") as c:
        r = await c.client.post("/v1/embeddings", json={"model": MINILM, "input": "hello"},
                                headers=bearer(seeded.key))
        assert r.status_code == 200, r.text
        for _ in range(100):  # the meter flushes every 0.1 s
            page = await c.client.get("/console/usage")
            if MINILM in page.text:
                break
            await asyncio.sleep(0.1)
        assert page.status_code == 200 and MINILM in page.text and "acme" in page.text
        jsonl = await c.client.get(f"/console/usage/export?format=jsonl&model={MINILM}")
        assert jsonl.status_code == 200
        assert re.search(r'"completion_tokens":\s*0', jsonl.text)
        assert re.search(r'"prompt_tokens":\s*3\b', jsonl.text)  # [CLS] hello [SEP]
