"""The worker's internal API on a real tiny-Llama engine: auth, generation, adapters, drain,
stats and metrics. (tests/e2e covers it as a live process, with gateways in front.)"""

from __future__ import annotations

import json

import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.devices import DEVICES, exact
from tests.workers.lora.helpers import make_peft_adapter
from workers import LLM, SamplingParams
from workers.async_engine import AsyncLLMEngine
from workers.server import WorkerOptions, create_app

SECRET = "worker-secret-for-tests"
AUTH = {"authorization": f"Bearer {SECRET}"}
MODEL = "tiny"
PROMPT = [5, 17, 301, 44, 9, 1200, 77]


def engine_args(device: str = "cpu", **extra):
    return dict(kv_cache_memory=8 << 20, enable_lora=True, max_loras=2, max_lora_rank=16,
                **exact(device)) | extra


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    """The worker's engine on the CPU, and on CUDA: the API end to end on either."""
    return request.param


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, tiny_llama_path):
    return make_peft_adapter(tiny_llama_path, tmp_path_factory.mktemp("ad") / "a", seed=3, r=8)


@pytest.fixture(scope="module")
def expected(tiny_llama_path, adapter, device):
    """Greedy texts from the offline engine on the same device: base and with the adapter."""
    llm = LLM(str(tiny_llama_path), **engine_args(device))
    llm.add_lora("a", str(adapter))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    base = llm.generate([PROMPT], params)[0].text
    tuned = llm.generate([PROMPT], params, lora="a")[0].text
    assert base != tuned
    return {"base": base, "adapter": tuned}


@pytest.fixture
def client(tiny_llama_path, device):
    engine = AsyncLLMEngine(str(tiny_llama_path), **engine_args(device))
    app = create_app(engine, WorkerOptions(model_name=MODEL, secret=SECRET, worker_id="w1",
                                           advertise_url="http://127.0.0.1:1"))
    with TestClient(app) as c:
        yield c


def complete(client, model=MODEL, **extra):
    return client.post("/v1/completions", headers=AUTH, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, **extra})


def test_everything_but_probes_needs_the_secret(client):
    for method, path in [("POST", "/v1/completions"), ("GET", "/stats"), ("GET", "/metrics"),
                         ("POST", "/admin/drain"), ("GET", "/v1/lora_adapters"),
                         ("POST", "/v1/load_lora_adapter"), ("GET", "/v1/models")]:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": SECRET}):
            resp = client.request(method, path, headers=headers, json={})
            assert resp.status_code == 401, (method, path, headers)
            assert resp.json()["error"]["code"] == "invalid_worker_secret"
    assert client.get("/health/live").status_code == 200
    assert client.get("/health/ready").status_code == 200


def test_generation_equals_the_offline_engine_streamed_or_not(client, expected):
    whole = complete(client, response_model="base-shown")
    assert whole.status_code == 200
    body = whole.json()
    assert body["choices"][0]["text"] == expected["base"]
    assert body["model"] == "base-shown"
    assert body["usage"]["completion_tokens"] == 8
    with client.stream("POST", "/v1/completions", headers=AUTH, json={
        "model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected["base"]
    assert chunks[-1]["usage"]["completion_tokens"] == 8


def test_tools_and_json_schema_through_the_worker_api(client):
    """A remote worker is the same engine: forced calls and schemas hold over HTTP too."""
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "additionalProperties": False,
        "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}}}
    resp = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": MODEL, "messages": [{"role": "user", "content": "find x"}], "tools": [tool],
        "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0,
        "max_tokens": 160})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "lookup" and set(json.loads(call["arguments"])) == {"q"}
    resp = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 160,
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
            "additionalProperties": False}}}})
    assert resp.status_code == 200, resp.text
    assert isinstance(json.loads(resp.json()["choices"][0]["message"]["content"])["n"], int)


def test_endless_schemas_are_a_400_and_broken_grammars_a_500(client, monkeypatch):
    """Issue 40 over the worker API: a schema no finite document satisfies is refused up
    front; a grammar that breaks midway (the check bypassed here) is a 500 `grammar_error`,
    an error event in a stream, and counted, never a 200 with a cut document."""
    from workers.runner import structured_backend

    endless = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}

    def ask(schema, **extra):
        return client.post("/v1/chat/completions", headers=AUTH, json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": schema, "strict": True}}, **extra})

    resp = ask(endless)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "recurses without end" in error["message"]
    monkeypatch.setattr(structured_backend, "unsatisfiable", lambda schema: None)
    resp = ask({**endless, "title": "whole"})
    assert resp.status_code == 500, resp.text
    assert resp.json()["error"]["code"] == "grammar_error"
    streamed = ask({**endless, "title": "streamed"}, stream=True)
    assert streamed.status_code == 200
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    assert events[-1]["error"]["code"] == "grammar_error" and "[DONE]" not in streamed.text
    assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
    text = client.get("/metrics", headers=AUTH).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("switchboard_worker_grammar_errors_total", ())] == 2
    assert samples[("switchboard_worker_requests_total",
                    (("kind", "chat"), ("status", "error")))] == 1


def test_bad_input_is_a_clear_4xx(client):
    resp = complete(client, model="nope")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    assert complete(client, cache_salt=5).status_code == 400
    assert complete(client, response_model=["x"]).status_code == 400
    resp = client.post("/v1/completions", headers=AUTH, content=b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_bodies_are_checked_by_the_gateways_own_models(client):
    """The same request models as the gateway: a wrong type names its field, and a field
    the engine does not take is refused by name, never ignored."""
    resp = complete(client, temperature="hot")
    assert resp.status_code == 400
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (
        "temperature", "invalid_value")
    resp = complete(client, vendor_knob=1)
    assert resp.status_code == 400
    assert (resp.json()["error"]["param"], resp.json()["error"]["code"]) == (
        "vendor_knob", "unsupported_parameter")
    resp = client.post("/v1/chat/completions", headers=AUTH, json={
        "model": MODEL, "messages": [{"role": "user", "content": "x", "colour": "red"}]})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages.0.colour"
    assert complete(client, cache_salt="tenant-a").status_code == 200


def test_adapters_load_hot_serve_replace_and_unload(client, adapter, expected, tmp_path):
    load = {"lora_name": "t1/a", "lora_path": str(adapter), "adapter_id": "id-1"}
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load).status_code == 200
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load).status_code == 200
    listed = client.get("/v1/lora_adapters", headers=AUTH).json()["data"]
    assert [(a["lora_name"], a["adapter_id"]) for a in listed] == [("t1/a", "id-1")]
    assert listed[0]["tier"] in ("device", "cpu")
    assert "t1/a" in [m["id"] for m in client.get("/v1/models", headers=AUTH).json()["data"]]
    assert complete(client, model="t1/a").json()["choices"][0]["text"] == expected["adapter"]
    assert complete(client).json()["choices"][0]["text"] == expected["base"]
    # The same name under a new registration (another path, another id) replaces it.
    other = make_peft_adapter(_base_of(adapter), tmp_path / "b", seed=9, r=4)
    load2 = {"lora_name": "t1/a", "lora_path": str(other), "adapter_id": "id-2"}
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load2).status_code == 200
    replaced = complete(client, model="t1/a").json()["choices"][0]["text"]
    assert replaced != expected["adapter"]
    stats = client.get("/stats", headers=AUTH).json()
    assert stats["adapters"]["t1/a"]["adapter_id"] == "id-2"
    resp = client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "t1/a"})
    assert resp.status_code == 200
    assert complete(client, model="t1/a").status_code == 404
    resp = client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "t1/a"})
    assert resp.status_code == 404


def _base_of(adapter):
    config = json.loads((adapter / "adapter_config.json").read_text())
    return config["base_model_name_or_path"]


def test_adapter_refusals(client, tmp_path):
    def load(**body):
        return client.post("/v1/load_lora_adapter", headers=AUTH, json=body)

    missing = load(lora_name="x", lora_path=str(tmp_path / "missing"))
    assert missing.status_code == 400 and missing.json()["error"]["param"] in ("lora_path", None)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{nope")
    assert load(lora_name="x", lora_path=str(tmp_path / "bad")).status_code == 400
    assert load(lora_name=MODEL, lora_path=str(tmp_path)).status_code == 400
    assert load(lora_name="", lora_path="p").status_code == 400
    resp = client.post("/v1/unload_lora_adapter", headers=AUTH,
                       json={"lora_name": "x", "wait_s": 999})
    assert resp.status_code == 400
    assert client.get("/v1/lora_adapters", headers=AUTH).json()["data"] == []


def test_drain_stops_new_work_and_resume_takes_it_again(client):
    resp = client.post("/admin/drain", headers=AUTH)
    assert resp.json() == {"draining": True, "in_flight": 0}
    assert client.get("/health/ready").status_code == 503
    assert client.get("/health/live").status_code == 200
    refused = complete(client)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "worker_draining"
    assert client.get("/stats", headers=AUTH).json()["ready"] is False
    assert client.post("/admin/drain", headers=AUTH, json={"drain": "no"}).status_code == 400
    client.post("/admin/drain", headers=AUTH, json={"drain": False})
    assert client.get("/health/ready").status_code == 200
    assert complete(client).status_code == 200


def test_stats_and_metrics_report_load_and_latency(client):
    assert complete(client).status_code == 200
    complete(client, model="nope")
    stats = client.get("/stats", headers=AUTH).json()
    assert stats["worker_id"] == "w1" and stats["url"] == "http://127.0.0.1:1"
    assert stats["model"] == MODEL and stats["ready"] is True and stats["in_flight"] == 0
    assert {"num_waiting", "num_running", "kv_cache_usage"} <= set(stats["stats"])
    text = client.get("/metrics", headers=AUTH).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("switchboard_worker_requests_total",
                    (("kind", "completion"), ("status", "ok")))] == 1
    assert samples[("switchboard_worker_requests_total",
                    (("kind", "completion"), ("status", "invalid")))] == 1
    assert samples[("switchboard_worker_time_to_first_token_seconds_count", ())] == 1
    assert samples[("switchboard_worker_time_per_output_token_seconds_count", ())] == 1
    assert samples[("switchboard_worker_generation_tokens_total", ())] == 8
    assert ("switchboard_worker_kv_cache_usage_ratio", ()) in samples
    assert ("switchboard_worker_preemptions_total", ()) in samples
    assert ("switchboard_worker_adapter_loads_total", ()) in samples


def test_metrics_under_vllms_names_for_schedulers_built_on_vllm(client, adapter):
    """What an InferencePool's endpoint picker reads from a vLLM pod, read from a worker."""
    load = {"lora_name": "ad1", "lora_path": str(adapter)}
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load).status_code == 200
    long_prompt = [(7 * i) % 2000 + 5 for i in range(48)]  # three blocks of 16
    assert complete(client, prompt=long_prompt).status_code == 200
    assert complete(client, prompt=long_prompt).status_code == 200  # again: prefix-cache hits
    text = client.get("/metrics", headers=AUTH).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    label = {"model_name": MODEL, "engine": "0"}
    for name, kind in [("vllm:num_requests_running", "gauge"),
                       ("vllm:num_requests_waiting", "gauge"),
                       ("vllm:kv_cache_usage_perc", "gauge"),
                       ("vllm:gpu_cache_usage_perc", "gauge"),
                       ("vllm:num_preemptions", "counter"),
                       ("vllm:prefix_cache_queries", "counter"),
                       ("vllm:prefix_cache_hits", "counter")]:
        assert families[name].type == kind, name
        [sample] = [s for s in families[name].samples if not s.name.endswith("_created")]
        assert sample.labels == label, name
    values = {s.name: s.value for f in families.values() for s in f.samples}
    assert values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0
    assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1
    queried = values["vllm:prefix_cache_queries_total"]
    hits = values["vllm:prefix_cache_hits_total"]
    assert queried >= 2 * len(long_prompt) - 1 and 0 < hits < queried
    for line in ("vllm:num_requests_running{", "vllm:prefix_cache_hits_total{",
                 "vllm:kv_cache_usage_perc{"):
        assert f'{line}engine="0",model_name="{MODEL}"}}' in text  # the exposition, verbatim
    [config] = families["vllm:cache_config_info"].samples
    assert int(config.labels["block_size"]) > 0 and int(config.labels["num_gpu_blocks"]) > 0
    [lora] = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                           "max_lora": "2"}  # nothing in flight between requests
    assert lora.value > 1.7e9  # the wall clock, as vLLM's


def test_lora_requests_info_names_the_adapters_in_use():
    from workers.lora.manager import AdapterStatus
    from workers.server.metrics import _lora_info

    family = _lora_info(4, [AdapterStatus("b", "device", False, 2, 8),
                            AdapterStatus("a", "device", False, 1, 8),
                            AdapterStatus("idle", "device", False, 0, 8),
                            AdapterStatus("cold", "disk", False, 3, 8),
                            AdapterStatus("warm", "cpu", False, 1, 8)])
    [sample] = family.samples
    assert sample.labels == {"running_lora_adapters": "a,b", "max_lora": "4",
                             "waiting_lora_adapters": "cold,warm"}


def test_models_lists_loaded_adapters_as_vllm_does(client, adapter, tiny_llama_path):
    def models():
        return client.get("/v1/models", headers=AUTH).json()["data"]

    [base] = models()
    assert base["id"] == MODEL and base["parent"] is None
    assert base["root"] == str(tiny_llama_path) and base["max_model_len"] > 0
    load = {"lora_name": "sql-lora", "lora_path": str(adapter)}
    assert client.post("/v1/load_lora_adapter", headers=AUTH, json=load).status_code == 200
    listed = models()
    assert [m["id"] for m in listed] == [MODEL, "sql-lora"]
    assert listed[1] == {"id": "sql-lora", "object": "model", "created": 0,
                         "owned_by": "switchboard", "root": str(adapter), "parent": MODEL}
    client.post("/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "sql-lora"})
    assert [m["id"] for m in models()] == [MODEL]


def test_the_gateways_tenant_fields_reach_the_fair_share(client):
    """tenant, engine_weight and priority (worker API fields the gateway sets from the key's
    plan) are checked, and the engine charges the named tenant: /stats shows its tokens."""
    assert complete(client, tenant="t-a", engine_weight=2.5, priority=1).status_code == 200
    assert complete(client).status_code == 200
    tenants = client.get("/stats", headers=AUTH).json()["tenants"]
    assert tenants == {"t-a": len(PROMPT) + 7, "": len(PROMPT) + 7}
    for bad in ({"tenant": 5}, {"engine_weight": 0}, {"engine_weight": 101},
                {"engine_weight": "2"}, {"engine_weight": True}, {"priority": 1.5}):
        resp = complete(client, **bad)
        assert resp.status_code == 400, bad
        assert resp.json()["error"]["param"] == next(iter(bad))


def test_speculative_decoding_is_counted_and_the_request_field_checked(tiny_llama_path):
    """A worker with prompt lookup: proposals show in /metrics by position, a request may turn
    them off with `speculative_tokens`, and may not ask for more than the engine's k."""
    engine = AsyncLLMEngine(str(tiny_llama_path), **engine_args(
        speculative={"method": "ngram", "num_tokens": 3}))
    app = create_app(engine, WorkerOptions(model_name=MODEL, secret=SECRET, worker_id="w1",
                                           advertise_url="http://127.0.0.1:1"))
    motif = {"prompt": [9, 1000, 2000, 3000] * 4, "max_tokens": 24,
             "logit_bias": {"1000": 100, "2000": 100, "3000": 100}}
    with TestClient(app) as client:
        off = complete(client, speculative_tokens=0, **motif)
        on = complete(client, **motif)
        assert off.status_code == on.status_code == 200
        assert on.json()["choices"][0]["text"] == off.json()["choices"][0]["text"]
        text = client.get("/metrics", headers=AUTH).text
        too_many = complete(client, speculative_tokens=4)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}
    proposed = samples[("switchboard_worker_spec_proposed_tokens_total", ())]
    assert proposed > 0
    assert samples[("switchboard_worker_spec_position_proposed_tokens_total",
                    (("position", "1"),))] > 0
    assert sum(value for (name, _), value in samples.items()
               if name == "switchboard_worker_spec_position_proposed_tokens_total") == proposed
    assert too_many.status_code == 400
    assert too_many.json()["error"]["param"] == "speculative_tokens"
