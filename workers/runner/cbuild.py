"""Build the C kernels in `csrc/` at first use and load them with ctypes.

Each kernel is plain C with a C ABI, compiled with the system compiler (`cc` with `FLAGS` and
`-march=native`, under a second) and cached per source (headers included), flags and CPU in the
user's cache directory. `-march=native` is how the code path is chosen at run time: the
AVX-512 intrinsics exist only in a build for a CPU that has them, and the portable loops are
vectorized for whatever the CPU has (AVX2 and FMA, or SSE). Tests build the other targets
(`march="x86-64-v3"`, AVX2; `"x86-64"`, SSE2) on the same machine to check each path.
OpenMP resolves to the runtime PyTorch has already loaded (same soname), so the kernels and
PyTorch share threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# -fno-trapping-math lets the compiler vectorize loops with selects around arithmetic (the
# softmax exp, SiLU): without it gcc 12 left them scalar on AVX2 (3.5x slower SiLU-and-multiply
# than torch on a Zen 3). It permits no reassociation, so each element's value is unchanged.
FLAGS = ("-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared",
         "-std=c11")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "switchboard" / "kernels"


def cpuinfo_line(key: str) -> str | None:
    """The first line of /proc/cpuinfo that starts with `key` (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line
    except OSError:
        pass
    return None


def cpu_signature() -> str:
    """The CPU's feature flags: -march=native code is only valid on a CPU that has them."""
    return cpuinfo_line("flags") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor_id ("AuthenticAMD", "GenuineIntel"; empty where none is listed): some
    kernels pay on one maker's cores and not the other's at the same flags."""
    line = cpuinfo_line("vendor_id")
    return line.split(":", 1)[1].strip() if line else ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags as a set (empty where /proc/cpuinfo lists none)."""
    line = cpu_signature()
    return set(line.split(":", 1)[1].split()) if line.startswith("flags") else set()


def build_and_load(name: str, what: str, march: str = "native") -> ctypes.CDLL:
    """`csrc/<name>.c` as a loaded library for the CPU target `march`, built unless this
    source, these flags and this CPU already have one. Raises RuntimeError naming `what` for
    anything that stops it: no compiler, a failed build, an unwritable cache, a library that
    does not load."""
    cc = compiler()
    if cc is None:
        raise RuntimeError(f"the {what} needs a C compiler (cc or gcc, or $CC)")
    flags = (*FLAGS, f"-march={march}")
    digest = hashlib.sha256(" ".join(flags).encode() + cpu_signature().encode())
    for source in (CSRC / f"{name}.c", *sorted(CSRC.glob("*.h"))):
        digest.update(source.read_bytes())
    target = cache_dir() / f"{name}-{digest.hexdigest()[:16]}.so"
    try:
        if not target.exists():
            _build(cc, flags, CSRC / f"{name}.c", target, what)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"building the {what} failed: {exc}") from exc


def _build(cc: str, flags: tuple[str, ...], source: Path, target: Path, what: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cc, *flags, f"-I{CSRC}", str(source), "-o", str(built), "-lm"],
                                capture_output=True, text=True, check=False, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"building the {what} failed:\n{result.stderr}")
        os.replace(built, target)  # atomic: concurrent builders race harmlessly
