"""Structured outputs: what a JSON schema costs the engine, and what a token mask costs.

Run from the repository root:

    .venv/bin/python bench/structured_output.py                 # standard workload
    .venv/bin/python bench/structured_output.py --num-requests 8 --max-prompt 64 --max-output 32

1. Throughput: the standard engine workload (64 chat requests, prompts 16-512 tokens,
   max_tokens 16-256, greedy, EOS ignored) run twice on one engine: all unconstrained, then
   with every other request under `BENCH_SCHEMA`. Its `minItems` needs more tokens than any
   request may make, so a constrained request never completes its document and makes exactly
   `max_tokens` tokens ("length"), as the unconstrained run does: both runs produce the same
   number of tokens and output tok/s compares like with like. One discarded pass over the
   workload comes first (kernels for each batch shape), then `--rounds` in alternating order
   (AB, BA, ...). The engine's own structured work is timed in place: filling the bitmask per
   constrained row per step, applying masks to the logits, and matchers taking tokens; its
   share of the wall time is the figure that does not drift with the machine's load.
2. Mask cost per token, llguidance (the engine's) against xgrammar (if installed): the same
   token paths replayed through both, timing only the bitmask fill per token. Paths: the
   constrained outputs of run 1 (`engine paths`, under BENCH_SCHEMA) and hand-written documents
   for a small suite of schemas, tokenized with SmolLM2's 49,152-token tokenizer.

Writes bench/results/structured_output-<device>.json (`-smoke` for other sizes) and prints a
table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `workers` and `bench` importable
    sys.path.insert(0, str(ROOT))

from bench.common.machine import cpu_model  # noqa: E402
from bench.common.workload import build_workload  # noqa: E402

RESULTS = ROOT / "bench" / "results"
STANDARD = {"num_requests": 64, "max_prompt": 512, "max_output": 256, "seed": 0}
BENCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"words": {"type": "array", "items": {"type": "string"}, "minItems": 256}},
    "required": ["words"],
}
_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
          "seven", "river", "engines", "sing"]
TOOL_SCHEMA: dict[str, Any] = {  # the shape workers/tools asks for under tool_choice=required
    "type": "array", "minItems": 1,
    "items": {"anyOf": [
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": "get_weather"}, "arguments": {
             "type": "object", "required": ["city"],
             "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                            "days": {"type": "integer"}}}}},
        {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
         "properties": {"name": {"const": "search"}, "arguments": {
             "type": "object", "required": ["query"],
             "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}}},
    ]},
}
# name -> (schema, a document valid for it); None as schema means json_object
SUITE: dict[str, tuple[dict[str, Any] | None, Any]] = {
    "person": ({"type": "object", "required": ["name", "age", "tags"], "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}}},
        {"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "ok": True}),
    "tool_call": (TOOL_SCHEMA, [
        {"name": "get_weather", "arguments": {"city": "Paris, France", "unit": "c", "days": 3}},
        {"name": "search", "arguments": {"query": "best pizza in Naples", "limit": 5}}]),
    "json_object": (None, {"a": [1, 2.5, {"b": None}], "c": "text with words", "d": False}),
    "bounded": ({"type": "object", "required": ["title", "words"], "properties": {
        "title": {"type": "string", "maxLength": 40},
        "words": {"type": "array", "items": {"type": "string", "maxLength": 16},
                  "maxItems": 64}}},
        {"title": "A short title", "words": _WORDS * 3}),
}


# ----------------------------------------------------------------------------- mask cost


class Library:
    """One grammar library behind a common face: compile, new matcher, fill, accept."""

    name: str

    def compile(self, schema: dict[str, Any] | None) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: Any) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...


class LLGuidance(Library):
    """The engine's own backend, used exactly as the engine uses it."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        from workers.runner.structured_backend import StructuredBackend

        self.backend = StructuredBackend(tokenizer, vocab, eos)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        from workers.engine.structured import StructuredOutputs

        spec = (StructuredOutputs(json_object=True) if schema is None
                else StructuredOutputs(json=schema))
        return self.backend.compile(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.backend.matcher(compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class XGrammar(Library):
    """xgrammar as vLLM runs it for JSON: compact separators, strict mode (no extra keys)."""

    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab,
                                                       stop_token_ids=eos)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        text = json.dumps(schema if schema is not None else {"type": "object"})
        return self.compiler.compile_json_schema(text, any_whitespace=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: Any) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def libraries(tokenizer: Any, vocab: int, eos: list[int]) -> list[Library]:
    libs: list[Library] = [LLGuidance(tokenizer, vocab, eos)]
    try:
        libs.append(XGrammar(tokenizer, vocab, eos))
    except ImportError:
        print("xgrammar not installed: pip install -c constraints-cpu.txt xgrammar==0.2.8 to "
              "compare", file=sys.stderr)
    return libs


def replay(lib: Library, schema: dict[str, Any] | None, paths: list[list[int]],
           vocab: int) -> dict[str, Any]:
    """Compile once, then per path: a fresh matcher, fill + accept per token (fill timed)."""
    import torch

    t0 = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = (time.perf_counter() - t0) * 1e3
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    times: list[float] = []
    for path in paths:
        matcher = lib.matcher(compiled)
        for token in path:
            start = time.perf_counter()
            lib.fill(matcher, bitmask)
            times.append(time.perf_counter() - start)
            if not lib.accept(matcher, token):
                raise RuntimeError(f"{lib.name} refused token {token} on a valid path")
    times.sort()
    n = len(times)
    return {"compile_ms": compile_ms, "tokens": n,
            "mean_us": sum(times) / n * 1e6 if n else None,
            "p50_us": times[n // 2] * 1e6 if n else None,
            "p99_us": times[min(n - 1, int(n * 0.99))] * 1e6 if n else None,
            "max_us": times[-1] * 1e6 if n else None}


def mask_costs(tokenizer: Any, vocab: int, eos: list[int],
               engine_paths: list[list[int]]) -> list[dict[str, Any]]:
    libs = libraries(tokenizer, vocab, eos)
    cases: list[tuple[str, dict[str, Any] | None, list[list[int]]]] = []
    if engine_paths:
        cases.append(("engine paths", BENCH_SCHEMA, engine_paths))
    for name, (schema, doc) in SUITE.items():
        cases.append((name, schema, [tokenizer.encode(json.dumps(doc), add_special_tokens=False)]))
    warm = [tokenizer.encode('{"a": 1}', add_special_tokens=False)]
    for lib in libs:  # one-off lazy set-up (tables, caches) is not a per-token cost
        replay(lib, None, warm, vocab)
    rows = []
    for case, schema, paths in cases:
        for lib in libs:
            rows.append({"case": case, "library": lib.name, **replay(lib, schema, paths, vocab)})
    return rows


# ----------------------------------------------------------------------------- throughput


class MaskTimer:
    """Times the engine's structured-output work in place: token_mask.fill (matchers fill the
    bitmask), token_mask.apply (masks on the logits) and StopChecker.advance_grammar
    (matchers take each kept token)."""

    def __init__(self) -> None:
        from workers.engine.stop_checker import StopChecker
        from workers.runner import token_mask

        self.module, self.engine_cls = token_mask, StopChecker
        self.fill_s = self.apply_s = self.accept_s = 0.0
        self.rows = self.steps = self.accepted = 0
        self._fill, self._apply = token_mask.fill, token_mask.apply
        self._advance = StopChecker.advance_grammar

    def __enter__(self) -> MaskTimer:
        def fill(matchers: list[Any], *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = self._fill(matchers, *args, **kwargs)
            self.fill_s += time.perf_counter() - start
            self.rows += len(matchers)
            self.steps += 1
            return out

        def apply(*args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            self._apply(*args, **kwargs)
            self.apply_s += time.perf_counter() - start

        def advance(checker: Any, seq: Any, token: int) -> tuple[bool, bool]:
            start = time.perf_counter()
            done = self._advance(checker, seq, token)
            self.accept_s += time.perf_counter() - start
            self.accepted += 1
            return done

        self.module.fill, self.module.apply = fill, apply
        self.engine_cls.advance_grammar = advance  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.fill, self.module.apply = self._fill, self._apply
        self.engine_cls.advance_grammar = self._advance  # type: ignore[method-assign]

    def summary(self, wall: float) -> dict[str, Any]:
        total = self.fill_s + self.apply_s + self.accept_s
        return {"steps_with_masks": self.steps, "masked_rows": self.rows,
                "fill_us_per_row": self.fill_s / self.rows * 1e6 if self.rows else None,
                "apply_us_per_row": self.apply_s / self.rows * 1e6 if self.rows else None,
                "accept_us_per_token": self.accept_s / self.accepted * 1e6
                if self.accepted else None,
                "fill_s": self.fill_s, "apply_s": self.apply_s, "accept_s": self.accept_s,
                "share_of_wall": total / wall}


def run(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[dict[str, Any], Any]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outputs)
    expected = sum(p.max_tokens for p in params)
    return {"wall_s": wall, "output_tokens": tokens, "output_tok_s": tokens / wall,
            "lengths_ok": tokens == expected}, outputs


def throughput(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from workers import LLM, SamplingParams
    from workers.engine.structured import StructuredOutputs

    llm = LLM(None, max_num_seqs=64, max_num_batched_tokens=2048,
              kv_cache_memory=args.kv_cache_mib << 20)
    wl = build_workload(llm.tokenizer, args.num_requests, args.max_prompt, args.max_output,
                        args.seed, rate=0.0)
    prompts = [r.prompt_token_ids for r in wl.requests]
    free = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
            for r in wl.requests]
    spec = StructuredOutputs(json=BENCH_SCHEMA)
    mixed = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, ignore_eos=True,
                            structured=spec) if i % 2 == 0 else p for i, p in enumerate(free)]
    # one discarded pass over the workload: kernels for every batch shape get made here
    start = time.perf_counter()
    llm.generate(prompts, mixed)
    print(f"warm-up pass: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    result: dict[str, Any] = {"workload": wl.summary(), "torch_threads": torch.get_num_threads()}
    rounds = []
    for r in range(args.rounds):  # alternate the order, so drift does not favour one run
        order = ("unconstrained", "half_json") if r % 2 == 0 else ("half_json", "unconstrained")
        this: dict[str, Any] = {}
        for name in order:
            with MaskTimer() as timer:
                stats, outputs = run(llm, prompts, mixed if name == "half_json" else free)
            stats["mask"] = timer.summary(stats["wall_s"]) if name == "half_json" else None
            print(f"round {r + 1} {name}: {stats['output_tok_s']:.1f} tok/s, "
                  f"{stats['wall_s']:.1f} s", file=sys.stderr, flush=True)
            this[name] = stats
            if name == "half_json":
                paths = [o.token_ids for i, o in enumerate(outputs) if i % 2 == 0]
                check_prefixes(outputs)
        this["ratio"] = this["half_json"]["output_tok_s"] / this["unconstrained"]["output_tok_s"]
        rounds.append(this)
    result["rounds"] = rounds
    total = {name: sum(r[name]["output_tokens"] for r in rounds)
             / sum(r[name]["wall_s"] for r in rounds) for name in ("unconstrained", "half_json")}
    result["overall"] = {**{f"{k}_tok_s": v for k, v in total.items()},
                         "ratio": total["half_json"] / total["unconstrained"]}
    result["engine_paths"] = paths
    result["vocab"] = llm.engine.vocab_size
    result["eos"] = llm.engine.eos_token_ids
    result["tokenizer"] = llm.tokenizer
    return result


def check_prefixes(outputs: list[Any]) -> None:
    """Constrained outputs must be prefixes of a valid document: they start `{"words": [`."""
    for output in outputs[::2]:
        if not output.outputs[0].text.startswith('{"words": ['):
            raise RuntimeError(f"constrained output off its schema: {output.outputs[0].text!r}")


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=STANDARD["num_requests"])
    parser.add_argument("--max-prompt", type=int, default=STANDARD["max_prompt"])
    parser.add_argument("--max-output", type=int, default=STANDARD["max_output"])
    parser.add_argument("--seed", type=int, default=STANDARD["seed"])
    parser.add_argument("--rounds", type=int, default=2, help="alternating order (AB BA ..)")
    parser.add_argument("--kv-cache-mib", type=int, default=1536)
    parser.add_argument("--masks-only", action="store_true", help="skip the engine runs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    standard = all(getattr(args, k) == v for k, v in STANDARD.items())

    if args.masks_only:
        from transformers import AutoTokenizer

        from workers.model_files import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
        tp: dict[str, Any] = {"vocab": len(tokenizer), "eos": [tokenizer.eos_token_id],
                              "engine_paths": [], "tokenizer": tokenizer}
    else:
        tp = throughput(args)
    masks = mask_costs(tp.pop("tokenizer"), tp.pop("vocab"), tp.pop("eos"),
                       tp.pop("engine_paths"))

    import torch

    record = {
        "benchmark": "structured_output",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "standard": standard, "args": vars(args), "schema": BENCH_SCHEMA,
        "throughput": tp, "mask_cost": masks,
    }
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = f"structured_output-{device}{'' if standard else '-smoke'}.json"
    if not args.masks_only:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / name).write_text(json.dumps(record, indent=2) + "\n")
    print_table(record)


def print_table(record: dict[str, Any]) -> None:
    print(f"\nstructured_output  {record['date']}  {record['machine']['cpu']}")
    tp = record["throughput"]
    if tp.get("rounds"):
        w = tp["workload"]
        print(f"workload: {w['num_requests']} requests, prompt {w['prompt_tokens']['min']}-"
              f"{w['prompt_tokens']['max']} tok, output {w['output_tokens']['min']}-"
              f"{w['output_tokens']['max']} tok (total {w['output_tokens']['total']}), "
              f"half under a JSON schema")
        print(f"{'round':>5}  {'run':>14}  {'out tok/s':>10}  {'wall s':>7}  {'tokens':>7}  "
              f"{'fill us/row':>11}  {'apply us/row':>12}  {'accept us':>9}  {'share':>6}  ratio")
        for i, rnd in enumerate(tp["rounds"]):
            for run_name in ("unconstrained", "half_json"):
                r = rnd[run_name]
                m = r["mask"] or {}
                fill = f"{m['fill_us_per_row']:.1f}" if m.get("fill_us_per_row") else ""
                apply = f"{m['apply_us_per_row']:.1f}" if m.get("apply_us_per_row") else ""
                accept = f"{m['accept_us_per_token']:.1f}" if m.get("accept_us_per_token") else ""
                share = f"{m['share_of_wall']:.1%}" if m else ""
                ratio = f"{rnd['ratio']:.3f}" if run_name == "half_json" else ""
                ok = "" if r["lengths_ok"] else " (short!)"
                print(f"{i + 1:>5}  {run_name:>14}  {r['output_tok_s']:>10.1f}  "
                      f"{r['wall_s']:>7.1f}  {r['output_tokens']:>7}{ok}  {fill:>11}  "
                      f"{apply:>12}  {accept:>9}  {share:>6}  {ratio}")
        o = tp["overall"]
        print(f"overall (tokens / wall over all rounds): unconstrained "
              f"{o['unconstrained_tok_s']:.1f} tok/s, half_json {o['half_json_tok_s']:.1f} "
              f"tok/s, ratio {o['ratio']:.3f}; share = structured work / wall of that run")
    print(f"\n{'mask cost (fill per token)':<28}{'library':>11}  {'compile ms':>10}  "
          f"{'tokens':>6}  {'mean us':>8}  {'p50 us':>7}  {'p99 us':>8}  {'max us':>8}")
    for r in record["mask_cost"]:
        print(f"{r['case']:<28}{r['library']:>11}  {r['compile_ms']:>10.1f}  {r['tokens']:>6}  "
              f"{r['mean_us']:>8.1f}  {r['p50_us']:>7.1f}  {r['p99_us']:>8.1f}  "
              f"{r['max_us']:>8.1f}")


if __name__ == "__main__":
    main()
