"""What a lent GPU machine has, and what `make gpu-wheels` adds for bench/gpu_check.py.

The lent machines (the device tool, /work/.library/device/KINDS.md) run an image with Python
3.12, torch 2.11+cu130, Triton, transformers and about two hundred other packages
(`DEVICE_IMAGE`), and no network. What the engine (`workers`) and its CUDA tests import
beyond that travels as wheels in `.whl/` (`GPU_WHEELS`, each at the version installed where
`make gpu-wheels` runs: the one that checkout's tests ran with), downloaded by `make
gpu-wheels` and installed there with `pip install --no-index --no-deps --target`. The
SmolLM2 tokenizer travels beside them (`TOKENIZER_DIR`):
the 94 MB GGUF it comes in does not fit the 64 MiB that travels, and the tests' tiny models
and the benchmark's random models need a real tokenizer.

tests/bench/test_gpu_check.py checks, without a network, that every third-party module the
engine and the CUDA tests import comes from the image or a wheel here, and that each wheel's
own requirements do too.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_DIR = ROOT / ".whl"
TOKENIZER_DIR = WHEEL_DIR / "smollm2-tokenizer"
# What travels is at most 64 MiB, the repository's tracked files (about 7 MiB) included.
WHEEL_BUDGET_BYTES = 40 << 20

# The image's Python packages, as KINDS.md lists them (read on a machine running it,
# 2026-11-17): torch 2.11.0+cu130, triton 3.6.0, transformers 5.17.0, safetensors 0.8.0,
# tokenizers 0.23.2, numpy 2.5.2, peft, pytest with pytest-timeout and pytest-xdist, httpx,
# prometheus-client, psutil, anyio, hypothesis, attrs among them.
_IMAGE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp
"""
DEVICE_IMAGE = frozenset(_IMAGE_PACKAGES.split())

# Not on the image, imported by `workers` or by the CUDA tests (with what needs them), and
# the requirements of those, by name: their versions are this venv's (`gpu_wheels`), so no pin
# here can drift from what the tests here ran with when a new release is installed.
GPU_WHEELS: tuple[str, ...] = (
    "pydantic",  # workers.config (EngineArgs), workers.protocol
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "llguidance",  # structured outputs (workers.runner.structured_backend)
    "starlette",  # the worker's HTTP API (workers.server), workers.telemetry
    "redis",  # the worker's heartbeats (workers.server.registration)
    "opentelemetry-api",  # workers.telemetry
    "opentelemetry-sdk",
    "opentelemetry-semantic-conventions",
    "pytest-asyncio",  # pyproject's asyncio_mode; async engine and server tests
    "jsonschema",  # tests/workers/test_structured_outputs.py
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
)


def gpu_wheels() -> dict[str, str]:
    """Each of `GPU_WHEELS` at the version installed here (PackageNotFoundError if one is
    not: the project's install brings them all)."""
    return {name: importlib.metadata.version(name) for name in GPU_WHEELS}


# pytest plugins the project's pytest settings (pyproject.toml) need, and the setting.
PYTEST_PLUGINS = {"pytest-asyncio": "asyncio_mode", "pytest-timeout": "timeout"}

# Imported by `workers` or the benchmarks only where a deployment or a flag asks for it; never
# by what the GPU check runs. module -> why it does not travel.
NOT_CARRIED: dict[str, str] = {
    "vllm": "the engine benchmark's opt-in vllm_cpu system (bench/common/vllm_runner.py), a "
            "CPU build the GPU check never runs",
    "opentelemetry.exporter": "the OTLP exporter, imported only when a trace endpoint is "
                              "configured (workers.telemetry.configure_tracing); its protobuf "
                              "chain would shadow the image's",
}

PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64", "manylinux_2_39_x86_64",
             "manylinux1_x86_64")


def normalize(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    """The normalized distribution name of a wheel file."""
    return normalize(path.name.split("-")[0])


def download_command(dest: Path, spec: str, python: str = sys.executable) -> list[str]:
    """pip download of one pinned wheel for the device's CPython 3.12 on x86-64 Linux."""
    cmd = [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return [*cmd, spec]


def prepare(dest: Path = WHEEL_DIR, *, python: str = sys.executable,
            tokenizer_source: Path | None = None) -> dict[str, object]:
    """`make gpu-wheels`: every wheel of `GPU_WHEELS` into `dest` (wheels of other versions
    removed), and the SmolLM2 tokenizer files into `dest/smollm2-tokenizer`."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = gpu_wheels()
    wanted = {normalize(n): v for n, v in pins.items()}
    for old in dest.glob("*.whl"):
        name, version = wheel_name(old), old.name.split("-")[1]
        if wanted.get(name) != version:
            old.unlink()
    have = {wheel_name(p) for p in dest.glob("*.whl")}
    for name, version in pins.items():
        if normalize(name) not in have:
            subprocess.run(download_command(dest, f"{name}=={version}", python), check=True)
    copy_tokenizer(tokenizer_source, dest / TOKENIZER_DIR.name)
    wheels = sorted(dest.glob("*.whl"))
    names = [wheel_name(p) for p in wheels]
    if sorted(names) != sorted(wanted) or len(set(names)) != len(names):
        raise RuntimeError(f"wheels in {dest} are {names}, expected one of each of "
                           f"{sorted(wanted)}")
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    if size > WHEEL_BUDGET_BYTES:
        raise RuntimeError(f"{dest} holds {size / 2**20:.1f} MiB, over the "
                           f"{WHEEL_BUDGET_BYTES >> 20} MiB budget")
    return {"wheels": [p.name for p in wheels], "bytes": size}


def copy_tokenizer(source: Path | None, out: Path) -> Path:
    """The tokenizer files (and config.json, for the special token ids) of the bundled
    SmolLM2, or of `source`."""
    if source is None:
        from workers.model_files import resolve_model

        source = resolve_model(None)
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name in (
                "chat_template.jinja", "config.json", "generation_config.json"):
            shutil.copy2(f, out / f.name)
    return out


def install_command(wheels: list[Path], target: Path, python: str = sys.executable) -> list[str]:
    """The device README's install: no index, no dependency resolution, into `target`."""
    return [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
            "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]


# ---- what the engine imports ------------------------------------------------------------


def imported_modules(files: list[Path]) -> set[str]:
    """Absolute imports (dotted names) anywhere in `files`, lazy ones included."""
    import ast

    names: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from a import b`: b may be a module (of a namespace package such as
                # opentelemetry) or a name in a; `owner` tries a.b, then a
                names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


OWN_PACKAGES = ("workers", "gateway", "tenancy", "caching", "billing", "tests", "bench")


def third_party(names: set[str], own: tuple[str, ...] = OWN_PACKAGES) -> set[str]:
    """The names that are neither the standard library nor this repository's packages."""
    return {n for n in names
            if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] not in own
            and n.split(".")[0] != "__future__"}


def owner(module: str) -> str | None:
    """The (normalized) installed distribution that provides `module`, found by its file:
    precise for namespace packages such as `opentelemetry` that many distributions share."""
    import importlib.util

    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:i]))
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        origin = spec.origin if spec.origin not in (None, "namespace") else None
        paths = [Path(origin)] if origin else [Path(p) / "__init__.py"
                                               for p in spec.submodule_search_locations or []]
        for path in paths:
            dist = _file_owners().get(path.resolve())
            if dist:
                return dist
    return None


_OWNERS: dict[Path, str] = {}


def _file_owners() -> dict[Path, str]:
    if not _OWNERS:
        for dist in importlib.metadata.distributions():
            name = normalize(dist.metadata["Name"])
            for f in dist.files or []:
                if f.suffix == ".py":
                    _OWNERS[Path(dist.locate_file(f)).resolve()] = name
    return _OWNERS


def requirements(name: str) -> set[str]:
    """What an installed distribution requires on the device (CPython 3.12 on Linux, no
    extras), normalized."""
    from packaging.requirements import Requirement

    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "extra": ""}
    out = set()
    for line in importlib.metadata.requires(name) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            out.add(normalize(req.name))
    return out


def manifest() -> str:
    """The declared lists, as JSON (for the GPU check's record)."""
    installed = {}
    for name in GPU_WHEELS:  # on the device: what the wheels installed, if they did
        try:
            installed[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed[name] = None
    return json.dumps({"wheels": installed, "not_carried": NOT_CARRIED})
