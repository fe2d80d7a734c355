"""vLLM's CPU build as a peer of bench/engine_throughput.py, checked without vLLM installed:
the systems flag, the child's interpreter, environment and arguments, the install's
requirement list, and the agreement with the engine."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

from bench import engine_throughput as et
from bench.common import vllm_peer
from bench.common.throughput_report import greedy_agreement

GIB = 2**30


def test_vllm_cpu_is_an_opt_in_system() -> None:
    args = et.parse_args(["--systems", "engine,vllm_cpu", "--device", "cpu"])
    assert et.parse_systems(args.systems) == ["engine", "vllm_cpu"]
    assert "vllm_cpu" not in et.parse_systems(et.parse_args(["--device", "cpu"]).systems)
    assert "vllm_cpu" in et.ONLINE_SYSTEMS  # offline and online like the others
    with pytest.raises(SystemExit):
        et.parse_systems("engine,vllm")
    child = et.parse_args(["--only", "vllm_cpu", "--mode", "offline", "--device", "cpu"])
    assert child.only == "vllm_cpu"


@pytest.mark.parametrize(("cores", "text"), [
    ([0], "0"), ([1, 0], "0-1"), ([0, 1, 2, 3], "0-3"), ([0, 2, 3, 6], "0,2-3,6"),
    ([5, 7, 8, 9, 11], "5,7-9,11"),
])
def test_cpu_list(cores: list[int], text: str) -> None:
    assert vllm_peer.cpu_list(cores) == text


@pytest.mark.parametrize(("nbytes", "gib"), [
    (1, 1), (GIB, 1), (GIB + 1, 2), (2 * GIB, 2), (2_320_000_000, 3),
])
def test_kv_space_is_the_budget_in_whole_gib_rounded_up(nbytes: int, gib: int) -> None:
    assert vllm_peer.kv_space_gib(nbytes) == gib
    assert vllm_peer.kv_space_gib(nbytes) * GIB >= nbytes  # never less room than the engine


def test_child_env() -> None:
    base = {"PATH": "/bin", "VIRTUAL_ENV": "/work/main/.venv", "PYTHONPATH": "/x",
            "LD_PRELOAD": "/lib/already.so"}
    env = vllm_peer.child_env(int(2.2 * GIB), [0, 1, 2, 3], ["/v/lib/libiomp5.so"], base=base)
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["LD_PRELOAD"] == "/v/lib/libiomp5.so:/lib/already.so"
    assert "VIRTUAL_ENV" not in env and "PYTHONPATH" not in env  # the project venv stays out
    assert env["PATH"] == "/bin"
    assert "LD_PRELOAD" not in vllm_peer.child_env(GIB, [0], base={})


def test_usable_cores_cover_the_affinity_unless_threads_cap_them() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert vllm_peer.usable_cores() == cores
    assert vllm_peer.usable_cores(1) == cores[:1]


def test_child_interpreter_and_argv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The vllm_cpu child: the venv's Python (no install here), the parent's KV budget and
    limits, every usable core bound; the other systems keep this interpreter and env."""
    venv_python = tmp_path / "venv" / "bin" / "python"
    monkeypatch.setattr(vllm_peer, "ensure_venv", lambda *a, **k: venv_python)
    args = et.parse_args(["--systems", "engine,vllm_cpu", "--device", "cpu",
                          "--max-num-seqs", "48", "--max-batched-tokens", "1024"])
    args.model_path = str(tmp_path / "model")
    args.kv_cache_bytes = int(2.16 * GIB)

    assert et.child_interpreter(args, "engine") == (sys.executable, None)
    python, env = et.child_interpreter(args, "vllm_cpu")
    assert python == str(venv_python)
    assert env is not None
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(math.ceil(args.kv_cache_bytes / GIB)) == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == vllm_peer.cpu_list(os.sched_getaffinity(0))
    assert "libiomp5" not in env.get("LD_PRELOAD", "")  # preloading is opt-in

    argv = et.child_argv(args, "vllm_cpu", "online", tmp_path / "w.json", tmp_path / "o.json",
                         python)
    assert argv[0] == str(venv_python)
    assert Path(argv[1]).name == "engine_throughput.py"
    flags = dict(zip(argv[2::2], argv[3::2], strict=False))
    assert flags["--only"] == "vllm_cpu" and flags["--mode"] == "online"
    assert flags["--kv-cache-bytes"] == str(args.kv_cache_bytes)
    assert flags["--max-num-seqs"] == "48" and flags["--max-batched-tokens"] == "1024"
    assert flags["--model-path"] == args.model_path and flags["--dtype"] == "float32"
    child = et.parse_args(argv[2:])
    assert (child.only, child.max_num_seqs, child.max_batched_tokens) == ("vllm_cpu", 48, 1024)

    args.vllm_preload = "auto"
    monkeypatch.setattr(vllm_peer, "preload_libraries", lambda *a: ["/v/lib/libiomp5.so"])
    _, env = et.child_interpreter(args, "vllm_cpu")
    assert env is not None and env["LD_PRELOAD"].startswith("/v/lib/libiomp5.so")

    args.device = "cuda"
    with pytest.raises(RuntimeError, match="cpu only"):
        et.child_interpreter(args, "vllm_cpu")


def test_engine_kwargs_prompts_and_sampling() -> None:
    kw = vllm_peer.engine_kwargs("/m", "float32", 64, 2048, seed=0)
    assert kw["model"] == kw["tokenizer"] == "/m"
    assert (kw["dtype"], kw["max_num_seqs"], kw["max_num_batched_tokens"]) == ("float32", 64, 2048)
    assert kw["disable_log_stats"] is False  # per-request timestamps need the stats
    ids = [[1, 2, 3], [4, 5]]
    assert vllm_peer.prompts_of(ids) == [{"prompt_token_ids": [1, 2, 3]},
                                         {"prompt_token_ids": [4, 5]}]
    sp = vllm_peer.sampling_kwargs(37)
    assert sp["temperature"] == 0.0 and sp["ignore_eos"] is True
    assert sp["max_tokens"] == sp["min_tokens"] == 37


def test_prompts_are_the_workloads_token_ids() -> None:
    from bench.common.workload import Request, Workload

    wl = Workload(seed=0, max_prompt=8, max_output=4, rate=2.0, requests=[
        Request(prompt_token_ids=[7, 8, 9], max_tokens=4),
        Request(prompt_token_ids=[1, 49151], max_tokens=2, arrival_offset=0.5)])
    again = Workload.from_dict(wl.to_dict())  # what the child reads
    prompts = vllm_peer.prompts_of(r.prompt_token_ids for r in again.requests)
    assert [p["prompt_token_ids"] for p in prompts] == [r.prompt_token_ids for r in wl.requests]


def test_runtime_requirements_skip_torch_family_extras_and_other_platforms() -> None:
    metadata = "\n".join([
        "Metadata-Version: 2.1", "Name: vllm-cpu", "Version: 0.32.0",
        "Requires-Dist: regex",
        "Requires-Dist: torch==2.13.0",
        "Requires-Dist: torchvision; platform_machine != \"riscv64\"",
        "Requires-Dist: torchaudio",
        "Requires-Dist: torchcodec>=0.14",
        "Requires-Dist: transformers<5.20.0,>=5.16.1",
        "Requires-Dist: xgrammar==0.2.8; platform_machine == \"x86_64\" or "
        "platform_machine == \"aarch64\"",
        "Requires-Dist: never-here; sys_platform == \"win32\"",
        "Requires-Dist: tensorizer; extra == \"tensorizer\"",
    ])
    reqs = vllm_peer.runtime_requirements(metadata)
    names = [r.split("<")[0].split("=")[0].split(">")[0] for r in reqs]
    assert "regex" in names and "transformers" in names
    assert not {"torch", "torchvision", "torchaudio", "torchcodec", "never-here",
                "tensorizer"} & set(names)
    assert "transformers<5.20.0,>=5.16.1" in reqs
    assert all(";" not in r for r in reqs)  # markers evaluated here, not passed to pip


def test_ensure_venv_is_a_no_op_once_installed(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    vllm_peer.installed_marker(venv).write_text(vllm_peer.VLLM_REQUIREMENT)
    assert vllm_peer.ensure_venv(venv) == venv / "bin" / "python"


def test_agreement_with_the_engine_counts_whole_outputs() -> None:
    engine = {"system": "engine", "mode": "offline", "heads": [[1], [2], [3], [4]],
              "outputs": [[1, 5], [2, 6], [3, 7], [4, 8]]}
    vllm = {"system": "vllm_cpu", "mode": "offline", "heads": [[1], [2], [3], [9]],
            "outputs": [[1, 5], [2, 6], [3, 0], [9, 8]]}
    online = {"system": "vllm_cpu", "mode": "online", "heads": [[1], [2], [3], [4]],
              "outputs": [[1, 5], [2, 6], [3, 7], [4, 8]]}
    results = [engine, vllm, online]
    greedy_agreement(results)
    assert vllm["greedy_agreement"] == 0.75  # first tokens (heads) vs the engine
    assert vllm["engine_agreement"] == 0.5  # every token
    assert online["engine_agreement"] == 1.0
    assert vllm["engine_agreement_reference"] == "engine/offline"
    assert "engine_agreement" not in engine


def test_runs_with_vllm_write_their_own_results_file() -> None:
    args = et.parse_args(["--systems", "engine,vllm_cpu", "--device", "cpu"])
    assert et.default_results_path(args, True).name == "engine_throughput-cpu-vllm_cpu.json"
    assert et.default_results_path(args, False).name == "engine_throughput-cpu-vllm_cpu-smoke.json"
    plain = et.parse_args(["--device", "cpu"])
    assert et.default_results_path(plain, True).name == "engine_throughput-cpu.json"
