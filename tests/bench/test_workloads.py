"""The engine benchmark's three workloads (issue 23): presets, overrides and length bounds."""

from __future__ import annotations

from bench import engine_throughput as et
from bench.common.workload import build_workload
from workers.model_files import resolve_model


def test_presets_fill_what_the_flags_leave_and_name_the_results():
    args = et.parse_args(["--workload", "long", "--device", "cpu"])
    assert (args.num_requests, args.min_prompt, args.max_prompt) == (16, 2048, 8000)
    assert (args.min_output, args.max_output) == (16, 64)
    assert et.default_results_path(args, True).name == "engine_throughput-cpu-long.json"
    args = et.parse_args(["--workload", "prefill", "--num-requests", "4", "--device", "cpu"])
    assert (args.num_requests, args.min_prompt, args.max_prompt) == (4, 128, 700)
    assert et.default_results_path(args, False).name == "engine_throughput-cpu-prefill-smoke.json"
    standard = et.parse_args(["--device", "cpu"])
    assert (standard.num_requests, standard.min_prompt, standard.max_output) == (64, 16, 256)


def test_lengths_stay_within_the_bounds():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
    wl = build_workload(tokenizer, 6, 900, 40, seed=3, rate=0.0, min_prompt=600, min_output=30)
    assert all(600 <= len(r.prompt_token_ids) <= 900 for r in wl.requests)
    assert all(30 <= r.max_tokens <= 40 for r in wl.requests)
