"""Tenant-owned LoRA adapters through the gateway, on the real embedded engine (tiny random
Llama, real peft adapters with random non-zero weights).

The yardstick for outputs is the engine used directly (`workers.LLM` + `add_lora`): the
gateway must give exactly its greedy text for the same prompt, under "<base>:<name>" and under
the alias. Around that: registration from a path (admin) and by upload (tenant), tenant
isolation on every adapter route, key scopes, refused files leaving nothing behind, unload
against in-flight requests, lazy re-registration, deletion, and replicas following changes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import event

from gateway.app import create_app
from tests.gateway.support import (
    Seeded,
    admin_key,
    assert_error,
    bearer,
    gateway_client,
    in_process,
    ok,
    seed_tenant,
    settings,
)
from tests.workers.lora.helpers import ALL_MODULES, make_peft_adapter
from workers import LLM, SamplingParams
from workers.async_engine import AsyncLLMEngine

BASE = "tiny"
MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Tell me about the robots of the north."}]
ADAPTER_SPECS = {
    "good": dict(seed=1, r=8, target_modules=ALL_MODULES),
    "other": dict(seed=2, r=4, lora_alpha=32, target_modules=["q_proj", "v_proj", "up_proj"]),
    "dora": dict(seed=3, r=4, use_dora=True, target_modules=["q_proj", "v_proj"]),
    "rank32": dict(seed=4, r=32, target_modules=["q_proj"]),
}


# --- fixtures -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peft_dirs(tmp_path_factory, tiny_llama_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    dirs = {name: make_peft_adapter(tiny_llama_path, root / name, **spec)
            for name, spec in ADAPTER_SPECS.items()}
    truncated = root / "truncated"
    truncated.mkdir()
    (truncated / "adapter_config.json").write_bytes(
        (dirs["good"] / "adapter_config.json").read_bytes())
    weights = (dirs["good"] / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(weights[: len(weights) // 2])
    dirs["truncated"] = truncated
    return dirs


@dataclass
class Reference:
    prompt_tokens: int
    text: dict[str | None, str]  # adapter (None: the base model) -> greedy text


@pytest.fixture(scope="module")
def reference(tiny_llama_path, peft_dirs) -> Reference:
    """The engine used directly, on the same prompt tokens the gateway builds from MESSAGES."""
    llm = LLM(str(tiny_llama_path), device="cpu", kv_cache_memory=8 << 20, enable_lora=True,
              max_lora_rank=16)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                               add_generation_prompt=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    text: dict[str | None, str] = {}
    prompt_tokens = 0
    for name in (None, "good", "other"):
        if name is not None:
            llm.add_lora(name, str(peft_dirs[name]))
        out = llm.generate(prompt, params, lora=name)[0]
        text[name] = out.outputs[0].text
        prompt_tokens = len(out.prompt_token_ids)
    assert len({text[None], text["good"], text["other"]}) == 3  # the adapters change outputs
    return Reference(prompt_tokens, text)


def tiny_engine(tiny_llama_path: Path) -> AsyncLLMEngine:
    return AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20,
                          enable_lora=True, max_loras=4, max_lora_rank=16)


@dataclass
class World:
    client: httpx.AsyncClient
    app: Any
    engine: AsyncLLMEngine
    admin: dict[str, str]
    a: Seeded
    b: Seeded
    adapter_dir: Path

    def openai(self, key: str) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url="http://gateway/v1", api_key=key,
                                  http_client=self.client, max_retries=0)


@pytest.fixture
async def world(sqlite_url, tmp_path, tiny_llama_path) -> AsyncIterator[World]:
    a = await seed_tenant(sqlite_url, tmp_path, name="initech")
    b = await seed_tenant(sqlite_url, tmp_path, name="umbrella")
    admin = bearer(await admin_key(sqlite_url, tmp_path))
    adapter_dir = tmp_path / "adapters"
    cfg = settings(sqlite_url, tmp_path, embedded={"name": BASE}, adapter_dir=adapter_dir)
    engine = tiny_engine(tiny_llama_path)
    app = create_app(cfg, engine=engine)
    async with in_process(app) as client:
        yield World(client, app, engine, admin, a, b, adapter_dir)


# --- helpers ------------------------------------------------------------------------------


def peft_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    return {"adapter_config": ("adapter_config.json",
                               (folder / "adapter_config.json").read_bytes()),
            "adapter_model": ("adapter_model.safetensors",
                              (folder / "adapter_model.safetensors").read_bytes())}


async def upload(client: httpx.AsyncClient, url: str, headers: dict[str, str], folder: Path,
                 **fields: str) -> httpx.Response:
    return await client.post(url, headers=headers, files=peft_files(folder),
                             data={"base_model": BASE, **fields})


async def chat(client: httpx.AsyncClient, key: str, model: str, **extra: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", headers=bearer(key), json={
        "model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, **extra})


async def models(client: httpx.AsyncClient, key: str) -> list[str]:
    return [m["id"] for m in ok(await client.get("/v1/models", headers=bearer(key)))["data"]]


def stored_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


async def engine_names(engine: AsyncLLMEngine) -> dict[str, str]:
    return {s.name: s.tier for s in await engine.list_loras()}


# --- registration from a path, and outputs ------------------------------------------------


async def test_admin_registers_a_path_and_the_tenant_uses_it(world, reference, peft_dirs):
    a = world.a
    created = ok(await world.client.post(
        f"/admin/tenants/{a.tenant_id}/adapters", headers=world.admin,
        json={"name": "ft", "base_model": BASE, "path": str(peft_dirs["good"]),
              "alias": "ft-alias"}), 201)
    assert (created["model"], created["alias"], created["uploaded"], created["pinned"]) == (
        "tiny:ft", "ft-alias", False, False)
    assert created["path"] == str(peft_dirs["good"]) and created["tenant_id"] == a.tenant_id
    assert created["residency"] in ("cpu", "device")  # validated by loading it

    client = world.openai(a.key)
    extra = {"ignore_eos": True}
    reply = await client.chat.completions.create(
        model="tiny:ft", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=extra)
    assert reply.model == "tiny:ft"
    assert reply.choices[0].message.content == reference.text["good"]
    assert reply.usage.prompt_tokens == reference.prompt_tokens
    assert reply.usage.completion_tokens == MAX_TOKENS

    base = await client.chat.completions.create(
        model=BASE, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
    assert base.model == BASE and base.choices[0].message.content == reference.text[None]

    by_alias = await client.chat.completions.create(
        model="ft-alias", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=extra)
    assert by_alias.model == "ft-alias"
    assert by_alias.choices[0].message.content == reference.text["good"]

    stream = await client.chat.completions.create(
        model="tiny:ft", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
        extra_body=extra, stream=True)
    chunks = [chunk async for chunk in stream]
    assert {c.model for c in chunks} == {"tiny:ft"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        reference.text["good"])

    assert {"tiny:ft", "ft-alias"} <= set(await models(world.client, a.key))
    listed = ok(await world.client.get(f"/admin/tenants/{a.tenant_id}/adapters",
                                       headers=world.admin))
    assert [(x["name"], x["residency"]) for x in listed] == [("ft", "device")]
    assert await engine_names(world.engine) == {f"{a.tenant_id}/ft": "device"}

    # Pinning is an admin decision, remembered in the row and applied in the engine.
    pinned = ok(await world.client.post(
        f"/admin/tenants/{a.tenant_id}/adapters/ft/load", headers=world.admin,
        params={"pinned": "true"}))
    assert pinned["pinned"] is True
    assert [s.pinned for s in await world.engine.list_loras()] == [True]

    # Deleting a path registration leaves the admin's folder alone.
    ok(await world.client.delete(f"/admin/tenants/{a.tenant_id}/adapters/ft",
                                 headers=world.admin))
    assert (peft_dirs["good"] / "adapter_model.safetensors").is_file()
    assert await engine_names(world.engine) == {}
    for model in ("tiny:ft", "ft-alias"):
        assert_error(await chat(world.client, a.key, model), 404, code="model_not_found")


async def test_lookups_are_cached_per_tenant(world, peft_dirs):
    """After the first request, an adapter costs no query: found or missing alike."""
    ok(await world.client.post(
        f"/admin/tenants/{world.a.tenant_id}/adapters", headers=world.admin,
        json={"name": "ft", "base_model": BASE, "path": str(peft_dirs["good"])}), 201)
    statements: list[str] = []
    event.listen(world.app.state.gateway.db.sync_engine, "before_cursor_execute",
                 lambda conn, cursor, sql, *args: statements.append(sql))
    results = await asyncio.gather(*[chat(world.client, world.a.key, "tiny:ft")
                                     for _ in range(6)])
    assert all(r.status_code == 200 for r in results)
    for _ in range(3):
        assert_error(await chat(world.client, world.a.key, "tiny:nope"), 404)
        assert_error(await chat(world.client, world.b.key, "tiny:ft"), 404)
    assert len([s for s in statements if "FROM adapters" in s]) == 3  # ft, nope, b's ft


# --- uploads and isolation ----------------------------------------------------------------


async def test_uploads_are_private_to_their_tenant(world, reference, peft_dirs):
    a, b, client = world.a, world.b, world.client
    created = ok(await upload(client, "/v1/adapters/upload", bearer(a.key), peft_dirs["other"],
                              name="mine", alias="mine-alias"), 201)
    assert created["model"] == "tiny:mine" and created["uploaded"] is True
    assert "path" not in created and "tenant_id" not in created  # no server folders to tenants
    files = stored_files(world.adapter_dir)
    assert sorted(p.name for p in files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert all(p.is_relative_to(world.adapter_dir / a.tenant_id) for p in files)

    assert {"tiny:mine", "mine-alias"} <= set(await models(client, a.key))
    assert ok(await client.get("/v1/models/tiny:mine", headers=bearer(a.key)))["id"] == (
        "tiny:mine")
    reply = ok(await chat(client, a.key, "tiny:mine"))
    assert reply["choices"][0]["message"]["content"] == reference.text["other"]

    # B: A's adapter looks exactly like a name nobody registered, everywhere.
    def same_as_unknown(found: httpx.Response, missing: httpx.Response, name: str,
                        unknown: str) -> None:
        seen = assert_error(found, 404, code="model_not_found")
        expected = assert_error(missing, 404, code="model_not_found")
        assert seen == {**expected, "message": expected["message"].replace(unknown, name)}

    for model in ("tiny:mine", "mine-alias"):
        same_as_unknown(await chat(client, b.key, model), await chat(client, b.key, "tiny:zz"),
                        model, "tiny:zz")
        same_as_unknown(await client.get(f"/v1/models/{model}", headers=bearer(b.key)),
                        await client.get("/v1/models/tiny:zz", headers=bearer(b.key)),
                        model, "tiny:zz")
    for method, suffix in (("POST", "/load"), ("POST", "/unload"), ("DELETE", "")):
        same_as_unknown(
            await client.request(method, f"/v1/adapters/mine{suffix}", headers=bearer(b.key)),
            await client.request(method, f"/v1/adapters/zz{suffix}", headers=bearer(b.key)),
            "mine", "zz")
    assert not {"tiny:mine", "mine-alias"} & set(await models(client, b.key))
    assert ok(await client.get("/v1/adapters", headers=bearer(b.key))) == []
    assert ok(await client.get(f"/admin/tenants/{b.tenant_id}/adapters",
                               headers=world.admin)) == []
    # ...and nothing B did touched it.
    assert [x["name"] for x in ok(await client.get("/v1/adapters", headers=bearer(a.key)))] == [
        "mine"]
    ok(await chat(client, a.key, "tiny:mine"))

    # B may use the same name for its own adapter: another engine registration entirely.
    ok(await upload(client, "/v1/adapters/upload", bearer(b.key), peft_dirs["good"],
                    name="mine"), 201)
    b_reply = ok(await chat(client, b.key, "tiny:mine"))
    a_reply = ok(await chat(client, a.key, "tiny:mine"))
    assert b_reply["choices"][0]["message"]["content"] == reference.text["good"]
    assert a_reply["choices"][0]["message"]["content"] == reference.text["other"]
    assert set(await engine_names(world.engine)) == {f"{a.tenant_id}/mine",
                                                     f"{b.tenant_id}/mine"}


async def test_key_scopes_apply_to_adapters(world, peft_dirs):
    a = world.a
    ok(await upload(world.client, "/v1/adapters/upload", bearer(a.key), peft_dirs["good"],
                    name="ft", alias="ft-alias"), 201)

    async def new_key(**scope: Any) -> str:
        return ok(await world.client.post(f"/admin/tenants/{a.tenant_id}/keys",
                                          headers=world.admin, json=scope), 201)["key"]

    other_only = await new_key(allowed_adapters=["something-else"])
    for model in ("tiny:ft", "ft-alias"):
        assert_error(await chat(world.client, other_only, model), 403,
                     code="adapter_not_allowed")
    assert "tiny:ft" not in await models(world.client, other_only)
    assert BASE in await models(world.client, other_only)
    assert_error(await world.client.post("/v1/adapters/ft/unload", headers=bearer(other_only)),
                 403, code="adapter_not_allowed")
    assert ok(await world.client.get("/v1/adapters", headers=bearer(other_only))) == []

    no_base = await new_key(allowed_models=["some-other-model"])
    assert_error(await chat(world.client, no_base, "tiny:ft"), 403, code="model_not_allowed")
    assert await models(world.client, no_base) == []

    allowed = await new_key(allowed_adapters=["ft"])
    ok(await chat(world.client, allowed, "ft-alias"))
    assert {"tiny:ft", "ft-alias"} <= set(await models(world.client, allowed))


# --- refused files leave nothing behind ---------------------------------------------------


async def test_refused_adapters_leave_no_row_and_no_files(world, peft_dirs):
    a, client = world.a, world.client
    tenant_url = "/v1/adapters/upload"
    admin_url = f"/admin/tenants/{a.tenant_id}/adapters"
    refusals = [
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["truncated"], name="t"),
         400, "corrupt"),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["dora"], name="d"),
         400, "DoRA"),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["rank32"], name="r"),
         400, "max_lora_rank=16"),
        (await upload(client, f"{admin_url}/upload", world.admin, peft_dirs["dora"], name="d"),
         400, "DoRA"),
        (await client.post(admin_url, headers=world.admin, json={
            "name": "t", "base_model": BASE, "path": str(peft_dirs["truncated"])}),
         400, "corrupt"),
        (await client.post(admin_url, headers=world.admin, json={
            "name": "gone", "base_model": BASE,
            "path": str(world.adapter_dir.parent / "gone")}),
         400, "adapter_config.json"),
        (await client.post(admin_url, headers=world.admin, json={
            "name": "rel", "base_model": BASE, "path": "peft/good"}), 400, "absolute"),
        # A tenant can never make the server read a folder: no such field, no such route.
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="p",
                      path=str(peft_dirs["good"])), 400, "path"),
        (await client.post("/v1/adapters", headers=bearer(a.key), json={
            "name": "p", "base_model": BASE, "path": str(peft_dirs["good"])}), 405, None),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="a:b"),
         400, None),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="../up"),
         400, None),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="x",
                      base_model="no-such-model"), 400, "serves adapters"),
        (await upload(client, tenant_url, {}, peft_dirs["good"], name="anon"), 401, None),
        (await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="sh",
                      alias=BASE), 400, "name of a model"),
    ]
    for response, status, words in refusals:
        error = assert_error(response, status)
        if words is not None:
            assert words in error["message"], error
        # Tenants never see where the server keeps uploads.
        assert str(world.adapter_dir) not in response.text
    assert ok(await client.get(admin_url, headers=world.admin)) == []
    assert stored_files(world.adapter_dir) == []
    assert await engine_names(world.engine) == {}

    # A duplicate is refused before its files are stored or read.
    ok(await upload(client, tenant_url, bearer(a.key), peft_dirs["good"], name="dup"), 201)
    assert_error(await upload(client, tenant_url, bearer(a.key), peft_dirs["other"],
                              name="dup"), 409)
    assert_error(await client.post(admin_url, headers=world.admin, json={
        "name": "dup", "base_model": BASE, "path": str(peft_dirs["other"])}), 409)
    assert len(stored_files(world.adapter_dir)) == 2


async def test_uploads_have_their_own_size_limit(sqlite_url, tmp_path, tiny_llama_path,
                                                 peft_dirs):
    a = await seed_tenant(sqlite_url, tmp_path, name="initech")
    cfg = settings(sqlite_url, tmp_path, embedded={"name": BASE}, max_body_bytes=1024,
                   max_adapter_upload_bytes=4096, adapter_dir=tmp_path / "adapters")
    async with gateway_client(cfg, engine=tiny_engine(tiny_llama_path)) as client:
        r = await upload(client, "/v1/adapters/upload", bearer(a.key), peft_dirs["good"],
                         name="big")
        assert assert_error(r, 413, code="body_too_large")["message"].endswith(
            "larger than 4096 bytes.")

        form = httpx.Request("POST", "http://gateway/v1/adapters/upload",
                             files=peft_files(peft_dirs["good"]),
                             data={"base_model": BASE, "name": "big"})
        body = form.read()

        async def chunked() -> AsyncIterator[bytes]:  # no content-length: counted as it comes
            for start in range(0, len(body), 1000):
                yield body[start:start + 1000]

        r = await client.post("/v1/adapters/upload", content=chunked(), headers={
            **bearer(a.key), "content-type": form.headers["content-type"]})
        assert_error(r, 413, code="body_too_large")
    assert stored_files(tmp_path / "adapters") == []


# --- unload, lazy reload, delete ----------------------------------------------------------


async def test_unload_waits_for_requests_and_reloads_lazily(world, reference, peft_dirs):
    a, client = world.a, world.client
    ok(await upload(client, "/v1/adapters/upload", bearer(a.key), peft_dirs["good"],
                    name="ft"), 201)
    folder = stored_files(world.adapter_dir)[0].parent

    async def long_stream() -> str:
        # Not from the response cache: this must run on the engine each time.
        r = await client.post("/v1/chat/completions", headers={
            **bearer(a.key), "cache-control": "no-cache"}, json={
            "model": "tiny:ft", "messages": MESSAGES, "max_tokens": 600, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text
        return r.text

    async def started() -> asyncio.Task[str]:
        stream = asyncio.create_task(long_stream())
        deadline = time.monotonic() + 30
        while sum(s.num_requests for s in await world.engine.list_loras()) == 0:
            assert time.monotonic() < deadline and not stream.done()
            await asyncio.sleep(0.005)
        return stream

    def completion_tokens(sse: str) -> int:
        events = [json.loads(line[6:]) for line in sse.splitlines() if line.startswith("data: {")]
        return events[-1]["usage"]["completion_tokens"]

    stream = await started()
    assert_error(await client.post("/v1/adapters/ft/unload", headers=bearer(a.key)), 409,
                 code="adapter_busy")
    assert_error(await client.delete(f"/admin/tenants/{a.tenant_id}/adapters/ft",
                                     headers=world.admin), 409, code="adapter_busy")
    assert not stream.done()  # the refusals did not disturb it
    assert completion_tokens(await stream) == 600  # it ran to the end

    unloaded = ok(await client.post("/v1/adapters/ft/unload", headers=bearer(a.key)))
    assert unloaded["residency"] == "unloaded"
    assert [x["residency"] for x in ok(await client.get(
        "/v1/adapters", headers=bearer(a.key)))] == ["unloaded"]
    assert await engine_names(world.engine) == {}

    # The next request registers it again, lazily, and gets the same outputs.
    reply = ok(await chat(client, a.key, "tiny:ft"))
    assert reply["choices"][0]["message"]["content"] == reference.text["good"]
    assert [x["residency"] for x in ok(await client.get(
        "/v1/adapters", headers=bearer(a.key)))] == ["device"]

    # Unload with wait_s drains a request in flight instead of refusing.
    stream = await started()
    drained = ok(await client.post("/v1/adapters/ft/unload", headers=bearer(a.key),
                                   params={"wait_s": 60}))
    assert drained["residency"] == "unloaded"
    assert completion_tokens(await stream) == 600  # drained, not cut short

    ok(await client.post("/v1/adapters/ft/load", headers=bearer(a.key)))
    assert set((await engine_names(world.engine)).values()) <= {"cpu", "device"}
    deleted = ok(await client.delete("/v1/adapters/ft", headers=bearer(a.key)))
    assert deleted["name"] == "ft"
    assert_error(await chat(client, a.key, "tiny:ft"), 404, code="model_not_found")
    assert "tiny:ft" not in await models(client, a.key)
    assert not folder.exists() and stored_files(world.adapter_dir) == []
    assert await engine_names(world.engine) == {}


# --- replicas -----------------------------------------------------------------------------


async def test_another_replica_follows_adapter_changes(db_url, tmp_path, tiny_llama_path,
                                                       reference, peft_dirs):
    """Two gateways on one database, each with its own engine: a deletion reaches the other
    within a poll, and a re-created name is served with its new files there too."""
    a = await seed_tenant(db_url, tmp_path, name="initech")
    admin = bearer(await admin_key(db_url, tmp_path))
    cfg = settings(db_url, tmp_path, embedded={"name": BASE}, auth_poll_interval_s=0.1,
                   adapter_dir=tmp_path / "adapters")
    async with gateway_client(cfg, engine=tiny_engine(tiny_llama_path)) as x, \
            gateway_client(cfg, engine=tiny_engine(tiny_llama_path)) as y:
        register = {"name": "ft", "base_model": BASE, "path": str(peft_dirs["good"])}
        ok(await x.post(f"/admin/tenants/{a.tenant_id}/adapters", headers=admin,
                        json=register), 201)
        first = ok(await chat(y, a.key, "tiny:ft"))  # registered lazily on y's engine
        assert first["choices"][0]["message"]["content"] == reference.text["good"]

        ok(await x.delete(f"/admin/tenants/{a.tenant_id}/adapters/ft", headers=admin))
        await until_status(y, a.key, "tiny:ft", 404)

        ok(await x.post(f"/admin/tenants/{a.tenant_id}/adapters", headers=admin,
                        json={**register, "path": str(peft_dirs["other"])}), 201)
        await until_status(y, a.key, "tiny:ft", 200)
        again = ok(await chat(y, a.key, "tiny:ft"))
        assert again["choices"][0]["message"]["content"] == reference.text["other"]


async def until_status(client: httpx.AsyncClient, key: str, model: str, status: int) -> None:
    deadline = time.monotonic() + 5
    while (r := await chat(client, key, model)).status_code != status:
        assert time.monotonic() < deadline, r.text
        await asyncio.sleep(0.05)
