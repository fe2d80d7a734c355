"""Structured outputs end to end on a tiny random Llama (SmolLM2's real tokenizer).

A random model wants to write anything; the grammar mask is all that keeps its output valid,
so every output parsing and validating is a real test of the masks and the matchers.
"""

from __future__ import annotations

import json
import logging
import re
import string

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.devices import DEVICES, exact
from tests.workers.lora.helpers import make_peft_adapter
from tests.workers.test_llm_tiny import random_prompts
from workers import LLM, InvalidRequestError, SamplingParams
from workers.async_engine import AsyncLLMEngine
from workers.client import GRAMMAR_ERROR, AnswerFailed, EmbeddedClient
from workers.engine.structured import StructuredOutputs
from workers.protocol.events import Failed, Finished, Usage
from workers.runner import structured_backend

MAX_TOKENS = 200
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
}
SELF = {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]}  # issue 40


@pytest.fixture(scope="module", params=DEVICES)
def llm(request, tiny_llama_path):
    """On the CPU, and on CUDA where the masks are applied to the device's logits."""
    return LLM(str(tiny_llama_path), kv_cache_memory=16 << 20, max_num_seqs=32,
               **exact(request.param))


def json_params(schema: dict, **kwargs) -> SamplingParams:
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured=StructuredOutputs(json=schema), **kwargs)


def assert_valid(output, schema: dict) -> None:
    for sample in output.outputs:
        assert sample.finish_reason == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), schema)


# ---- random schemas -----------------------------------------------------------------------

_names = st.from_regex(r"[a-z]{1,6}", fullmatch=True)
_words = st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=6)
_items = st.sampled_from([
    {"type": "string", "maxLength": 5}, {"type": "integer", "minimum": -5, "maximum": 50},
    {"type": "boolean"},
])
_properties = st.one_of(
    st.just({"type": "boolean"}),
    st.integers(-100, 100).map(lambda lo: {"type": "integer", "minimum": lo,
                                           "maximum": lo + 1000}),
    st.integers(0, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.lists(_words, min_size=1, max_size=4, unique=True).map(lambda xs: {"enum": xs}),
    st.tuples(_items, st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "maxItems": t[1]}),
)
schemas = st.dictionaries(_names, _properties, min_size=1, max_size=4).flatmap(
    lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
        lambda required: {"type": "object", "properties": props, "required": required}))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 2**16))
def test_outputs_always_validate_against_random_schemas(llm, schema, seed):
    prompts = random_prompts(2, seed=seed, hi=20)
    params = [json_params(schema), json_params(schema, temperature=1.0, seed=seed)]
    for output in llm.generate(prompts, params):
        assert_valid(output, schema)


# ---- the engine's paths ---------------------------------------------------------------------

def test_greedy_seeded_and_n_samples_each_follow_the_schema(llm):
    prompts = random_prompts(3, seed=1, hi=30)
    params = [json_params(PERSON), json_params(PERSON, temperature=0.9, seed=7, n=3),
              json_params(PERSON, temperature=1.3, top_p=0.9, top_k=50, seed=8,
                          presence_penalty=0.5)]
    outputs = llm.generate(prompts, params)
    for output in outputs:
        assert_valid(output, PERSON)
    again = llm.generate(prompts, params)  # seeded and greedy: reproducible
    assert [[s.token_ids for s in o.outputs] for o in again] == \
        [[s.token_ids for s in o.outputs] for o in outputs]


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm):
    prompts = random_prompts(6, seed=2, hi=40)
    free = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)]
    alone = llm.generate(prompts[:2], free)
    mixed = llm.generate(prompts, [*free, json_params(PERSON),
                                   json_params(PERSON, temperature=1.0, seed=4),
                                   SamplingParams(temperature=0, max_tokens=8,
                                                  structured=StructuredOutputs(regex="[0-9]{4}")),
                                   json_params(PERSON, n=2, temperature=1.0, seed=5)])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    for output in (mixed[2], mixed[3], mixed[5]):
        assert_valid(output, PERSON)
    assert re.fullmatch("[0-9]{4}", mixed[4].text)


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    prompts = random_prompts(2, seed=3, hi=20)
    outputs = llm.generate(prompts, json_params(PERSON, ignore_eos=True))
    for output in outputs:
        assert_valid(output, PERSON)  # "stop" at the closing brace: nothing may follow it
        assert output.text.endswith("}")
        assert not set(output.token_ids) & set(llm.engine.eos_token_ids)


def test_eos_only_where_the_grammar_allows_it(llm):
    eos = llm.engine.eos_token_ids[0]
    outputs = llm.generate(random_prompts(3, seed=4, hi=20),
                           json_params(PERSON, logit_bias={eos: 100.0}))
    for output in outputs:
        assert_valid(output, PERSON)
        assert eos not in output.token_ids  # a complete document ends without asking for EOS
    regex = SamplingParams(temperature=0, max_tokens=20, logit_bias={eos: 100.0},
                           structured=StructuredOutputs(regex="[a-z]+"))
    for output in llm.generate(random_prompts(2, seed=5, hi=20), regex):
        # EOS is allowed once one letter is there; +100 then picks it at once
        assert re.fullmatch("[a-z]+", output.text) and output.token_ids[-1] == eos
        assert output.outputs[0].finish_reason == "stop" and len(output.token_ids) == 2


def test_choice_regex_grammar_and_json_object(llm):
    prompts = random_prompts(4, seed=5, hi=20)
    choices = ["yes", "no", "maybe not", "ünïcode \"quoted\""]
    grammar = 'root ::= "(" digits ("," digits)* ")"\ndigits ::= [0-9] | [0-9] [0-9]'
    lark = 'start: "<" NAME ">"\nNAME: /[a-z]{1,8}/'
    specs = [StructuredOutputs(choice=choices), StructuredOutputs(regex=r"[a-c]{2,5}-\d{3}"),
             StructuredOutputs(grammar=grammar), StructuredOutputs(json_object=True),
             StructuredOutputs(grammar=lark)]
    params = [SamplingParams(temperature=1.0, seed=i, n=3, max_tokens=80, structured=spec)
              for i, spec in enumerate(specs)]
    choice, regex, ebnf, obj, tag = llm.generate([*prompts, prompts[0]], params)
    assert all(s.text in choices and s.finish_reason == "stop" for s in choice.outputs)
    assert all(re.fullmatch(r"[a-c]{2,5}-\d{3}", s.text) for s in regex.outputs)
    assert all(re.fullmatch(r"\((\d{1,2})(,\d{1,2})*\)", s.text) or s.finish_reason == "length"
               for s in ebnf.outputs)
    for sample in obj.outputs:
        if sample.finish_reason == "stop":  # any JSON object: it may nest past max_tokens
            assert isinstance(json.loads(sample.text), dict)
    assert all(re.fullmatch("<[a-z]{1,8}>", s.text) for s in tag.outputs)


@pytest.mark.parametrize(("spec", "param"), [
    (StructuredOutputs(json={"type": "no-such-type"}), "structured.json"),
    (StructuredOutputs(json='{"type": "object"', param="guided_json"), "guided_json"),
    (StructuredOutputs(json={"$ref": "#/$defs/missing"},
                       param="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (StructuredOutputs(regex="a(b", param="guided_regex"), "guided_regex"),
    (StructuredOutputs(grammar="root ::= undefined_rule"), "structured.grammar"),
    (StructuredOutputs(grammar='start: "a', param="guided_grammar"), "guided_grammar"),
    (StructuredOutputs(json={"type": "object", "minProperties": "x"}), "structured.json"),
])
def test_bad_constraints_are_refused_before_anything_is_queued(llm, spec, param):
    good = json_params(PERSON)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [good, SamplingParams(structured=spec)])
    assert info.value.param == param
    assert not llm.engine.has_unfinished_requests()


def test_each_schema_compiles_once(llm):
    schema = {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"]}
    grammars = llm.engine.grammars()
    before = grammars.num_compiles
    for _ in range(3):
        llm.engine.prepare_request("hi", json_params(schema))
    llm.engine.prepare_request("hi", json_params({"required": ["k"], **schema}))  # other text
    assert grammars.num_compiles == before + 2


def test_logit_bias_forces_and_bans_tokens(llm):
    prompt = random_prompts(1, seed=6)[0]
    forced = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                   logit_bias={1234: 100}))[0]
    assert forced.token_ids == [1234] * 8
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8,
                                                  ignore_eos=True))[0].token_ids
    banned = set(plain)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                logit_bias=dict.fromkeys(banned, -100)))[0]
    assert not banned & set(out.token_ids)
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.prepare_request("hi", SamplingParams(logit_bias={llm.engine.vocab_size: 1}))
    assert info.value.param == "logit_bias"


@pytest.mark.parametrize("device", DEVICES)
def test_matchers_survive_preemption(tiny_llama_path, device):
    prompts = random_prompts(6, seed=7, lo=20, hi=60)
    params = [json_params(PERSON, max_tokens=100),
              json_params(PERSON, temperature=1.0, seed=9, n=2, max_tokens=100)] * 3
    roomy = LLM(str(tiny_llama_path), kv_cache_memory=16 << 20, **exact(device))
    expected = roomy.generate(prompts, params)
    # 12 blocks of 16 float32 tokens: far less than 9 sequences of up to ~100 tokens need
    tight = LLM(str(tiny_llama_path), block_size=16,
                kv_cache_memory=12 * 16 * 2 * 3 * 2 * 16 * 4, **exact(device))
    outputs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [[s.token_ids for s in o.outputs] for o in outputs] == \
        [[s.token_ids for s in o.outputs] for o in expected]
    for output in outputs:
        assert_valid(output, PERSON)


def test_constrained_rows_with_a_lora_adapter(tiny_llama_path, tmp_path):
    adapter = make_peft_adapter(tiny_llama_path, tmp_path / "adapter", seed=3, r=8)
    llm = LLM(str(tiny_llama_path), kv_cache_memory=16 << 20, enable_lora=True, max_loras=2)
    llm.add_lora("a", str(adapter))
    prompts = random_prompts(4, seed=8, hi=30)
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompts[:1], free, lora="a")[0].token_ids
    outputs = llm.generate(prompts, [free, json_params(PERSON), json_params(PERSON, seed=2,
                                                                            temperature=1.0),
                                     json_params(PERSON)], lora=["a", "a", None, "a"])
    assert outputs[0].token_ids == alone
    for output in outputs[1:]:
        assert_valid(output, PERSON)


@pytest.mark.parametrize("device", DEVICES)
async def test_async_engine_serves_structured_requests(tiny_llama_path, device):
    engine = AsyncLLMEngine(str(tiny_llama_path), device=device, kv_cache_memory=16 << 20)
    await engine.start()
    try:
        prepared = engine._require_engine().prepare_request("hello", json_params(PERSON))
        last = None
        async for out in engine.generate(prepared, request_id="p"):
            last = out
        assert last is not None
        assert_valid(last, PERSON)
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate("x", SamplingParams(
                    structured=StructuredOutputs(regex="(("))):
                pass
    finally:
        await engine.shutdown()


# ---- schemas that cannot finish, grammars that break (issue 40) ------------------------------

def test_a_schema_that_never_ends_is_refused_before_anything_is_queued(llm):
    spec = StructuredOutputs(json=SELF, param="response_format.json_schema.schema")
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [json_params(PERSON), SamplingParams(structured=spec)])
    assert info.value.param == "response_format.json_schema.schema"
    assert "recurses without end" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_recursion_with_a_way_out_still_runs_and_ends_by_the_schema_or_length(llm):
    """A linked list: the grammar may recurse, the model may follow it; it ends as a complete
    document ("stop") or at max_tokens ("length"), never as a cut document marked "stop"."""
    linked = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0,
                                                     "maximum": 9},
                                               "next": {"$ref": "#"}},
              "required": ["v"]}
    outputs = llm.generate(random_prompts(4, seed=11, hi=20),
                           json_params(linked, temperature=1.0, seed=3, n=2, max_tokens=40))
    for sample in (s for o in outputs for s in o.outputs):
        assert sample.finish_reason in ("stop", "length")
        if sample.finish_reason == "stop":
            jsonschema.validate(json.loads(sample.text), linked)


def test_a_grammar_that_breaks_fails_its_sample_loudly(llm, monkeypatch, caplog):
    """Were the endless schema let through (as a case the check cannot see would be),
    llguidance breaks after `{"`: the sample ends with "error", not "stop" (issue 40: `{"`
    answered 200 as a finished document), logged at error level with the request id and
    counted; its neighbours in the batch are unaffected."""
    monkeypatch.setattr(structured_backend, "unsatisfiable", lambda schema: None)
    before = llm.engine.num_grammar_errors
    with caplog.at_level(logging.ERROR, logger="workers.engine.stop_checker"):
        broken, fine = llm.generate(random_prompts(2, seed=12, hi=20),
                                    [json_params({**SELF, "title": "unseen"}),
                                     json_params(PERSON)])
    assert broken.outputs[0].finish_reason == "error"
    assert broken.outputs[0].text.startswith('{"')
    assert_valid(fine, PERSON)
    assert llm.engine.num_grammar_errors == before + 1
    assert llm.engine.stats()["num_grammar_errors"] == before + 1
    logged = [r for r in caplog.records if r.levelno == logging.ERROR
              and broken.request_id in r.getMessage()]
    assert len(logged) == 1 and "outside its grammar" in logged[0].getMessage()


async def test_a_broken_grammar_reaches_the_client_as_a_failure(tiny_llama_path, monkeypatch):
    """Through the OpenAI-shaped client: `Failed` (500, grammar_error) instead of `Finished`,
    and no usage event claiming a finished answer; the whole response raises."""
    monkeypatch.setattr(structured_backend, "unsatisfiable", lambda schema: None)
    engine = AsyncLLMEngine(str(tiny_llama_path), device="cpu", kv_cache_memory=16 << 20)
    await engine.start()
    try:
        client = EmbeddedClient(engine, "tiny")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30,
                "temperature": 0, "response_format": {"type": "json_schema", "json_schema": {
                    "name": "n", "schema": SELF, "strict": True}}}
        call = client.prepare(body, chat=True)
        events = [e async for e in client.events(call, request_id="g1")]
        assert isinstance(events[-1], Failed)
        assert (events[-1].status, events[-1].code) == (500, GRAMMAR_ERROR)
        assert "g1" in events[-1].message
        assert not any(isinstance(e, Finished | Usage) for e in events)
        assert not call.usage.finished and call.usage.completion_tokens >= 1
        with pytest.raises(AnswerFailed) as info:
            await client.complete(client.prepare(body, chat=True), request_id="g2")
        assert info.value.failed.code == GRAMMAR_ERROR
        monkeypatch.undo()  # the check back: the same kind of schema is a 400 up front
        other = {**SELF, "title": "checked"}
        with pytest.raises(InvalidRequestError) as refused:
            client.prepare({**body, "response_format": {"type": "json_schema", "json_schema": {
                "name": "n", "schema": other, "strict": True}}}, chat=True)
        assert refused.value.param == "response_format.json_schema.schema"
    finally:
        await engine.shutdown()
