"""A GGUF file's metadata, read without transformers, and what it means for the conversion
(workers/model_files.py): whether a family serves the architecture once transformers has read
it (`check_gguf_served`), and the settings the file states but transformers' GGUF reader drops
(`gguf_config_overrides`: Qwen3's head size, Gemma 2's soft-capping, Gemma 3's and Llama 3's
RoPE scaling, Phi-3's window and LongRoPE), handed to `from_pretrained`.

`read_gguf_header` parses the header (metadata and the tensors' table) in milliseconds, and
`GgufHeader.f32` reads the few small float tensors the settings are recovered from.
"""

from __future__ import annotations

import logging
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


# llama.cpp's architecture name -> the family serving the model transformers builds from it.
# llama.cpp writes Mistral (and Mixtral) checkpoints as `llama`: transformers reads a dense one
# as a Llama, which is what llama.cpp runs too (it ignores Mistral's sliding window).
GGUF_SERVED_ARCHS = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
    "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
}


def check_gguf_served(metadata: dict[str, Any], path: Path) -> None:
    """Refuse, before transformers reads a tensor, a GGUF whose architecture no family serves
    once converted, or one transformers would read wrongly (a Mixtral: arch `llama` with
    experts, which it loads as a dense Llama with random MLPs)."""
    from workers.runner.models.registry import UnsupportedModelError

    arch = metadata.get("general.architecture")
    served = ", ".join(sorted(GGUF_SERVED_ARCHS))
    if arch not in GGUF_SERVED_ARCHS:
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture {arch!r} is not served by this engine (GGUF "
            f"architectures served: {served}; a HF folder of the model may be)", param="model")
    if arch == "llama" and metadata.get("llama.expert_count"):
        raise UnsupportedModelError(
            f"{path.name}: GGUF architecture 'llama' with {metadata['llama.expert_count']} "
            "experts (a Mixtral) is not served from GGUF: transformers reads it as a dense "
            "Llama and drops the experts; serve the HF folder (MixtralForCausalLM) instead",
            param="model")


def gguf_config_overrides(header: GgufHeader) -> dict[str, Any]:
    """Config settings the GGUF states that transformers' GGUF reader leaves at its config
    class's defaults (as of transformers 5): passed to `from_pretrained` so the model built is
    the one llama.cpp runs. Empty where the reader takes everything. RoPE scaling stored as a
    tensor that cannot be turned back into settings is warned about (served unscaled, as
    transformers serves it)."""
    metadata = header.metadata
    arch = metadata.get("general.architecture")

    def get(key: str) -> Any:
        return metadata.get(f"{arch}.{key}")

    overrides: dict[str, Any] = {}
    if arch == "qwen3" and get("attention.key_length"):
        overrides["head_dim"] = get("attention.key_length")  # Qwen3Config's default is 128
    if arch == "qwen3moe" and get("expert_feed_forward_length"):
        overrides["moe_intermediate_size"] = get("expert_feed_forward_length")  # default 768
    if arch == "gemma2":  # defaults 50 / 30; llama.cpp reads 0 as no capping
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                overrides[key] = float(get(key)) or None
    if arch == "gemma3" and get("rope.scaling.type") == "linear" and get("rope.scaling.factor"):
        # the global layers' linear scaling (Gemma 3 4B and up); the local layers keep theta
        # 10000 unless the file says otherwise
        overrides["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(get("rope.freq_base_swa") or 10000.0)},
            "full_attention": {"rope_type": "linear",
                               "factor": float(get("rope.scaling.factor")),
                               "rope_theta": float(get("rope.freq_base") or 1000000.0)}}
    if arch == "phi3":
        overrides.update(_phi3_overrides(header))
    if "rope_freqs.weight" in header.tensors:  # llama.cpp's form of Llama 3.1+'s scaling
        divisors = header.f32("rope_freqs.weight")
        rope = _llama3_rope(divisors, float(get("rope.freq_base") or 10000.0))
        if rope is not None:
            overrides["rope_parameters"] = rope
        elif max(divisors) > 1.0 + 1e-6:  # all 1: no scaling, nothing lost
            logger.warning("%s: its RoPE scaling tensor rope_freqs.weight fits no llama3 "
                           "RoPE settings and transformers' GGUF reader drops it: served with "
                           "unscaled RoPE, as transformers serves it", header.path.name)
    return overrides


def _phi3_overrides(header: GgufHeader) -> dict[str, Any]:
    """Phi-3's window, its RoPE over part of each head (Phi-4-mini), and LongRoPE, which
    llama.cpp stores as two factor tensors and the original context length."""
    metadata = header.metadata
    overrides: dict[str, Any] = {}
    if metadata.get("phi3.attention.sliding_window"):  # 0: none
        overrides["sliding_window"] = metadata["phi3.attention.sliding_window"]
    rope: dict[str, Any] = {"rope_type": "default",
                            "rope_theta": float(metadata.get("phi3.rope.freq_base", 10000.0))}
    head_dim = metadata["phi3.embedding_length"] // metadata["phi3.attention.head_count"]
    rotary = metadata.get("phi3.rope.dimension_count") or head_dim
    if rotary != head_dim:
        rope["partial_rotary_factor"] = rotary / head_dim
    original = metadata.get("phi3.rope.scaling.original_context_length")
    factors = {"rope_factors_long.weight", "rope_factors_short.weight"}
    if original and factors <= header.tensors.keys():
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    short_factor=header.f32("rope_factors_short.weight"),
                    long_factor=header.f32("rope_factors_long.weight"))
        overrides["original_max_position_embeddings"] = original
    if rope != {"rope_type": "default", "rope_theta": rope["rope_theta"]}:
        overrides["rope_parameters"] = rope
    return overrides


def _llama3_rope(divisors: list[float], theta: float) -> dict[str, Any] | None:
    """Llama 3's RoPE settings back from llama.cpp's `rope_freqs` (per frequency, the plain
    inverse frequency over the scaled one), or None where they cannot be told.

    The divisor is 1 for wavelengths under L / high_freq_factor, `factor` over L /
    low_freq_factor, and 1 / ((1 - s) / factor + s) between, s = (L / wavelength - low) /
    (high - low): linear in 1 / wavelength, so two frequencies between fix the two boundaries.
    Only their ratios to L matter, so low_freq_factor is taken as 1, as every Llama 3.x has
    it. The settings found must give back every divisor."""
    half = len(divisors)
    wavelengths = [2 * math.pi * theta ** (2 * i / (2 * half)) for i in range(half)]
    factor = max(divisors)
    if factor <= 1.0 + 1e-6:
        return None
    between = [(1 / w, (1 / d - 1 / factor) / (1 - 1 / factor))
               for w, d in zip(wavelengths, divisors, strict=True)
               if 1.0 + 1e-4 < d < factor * (1 - 1e-4)]
    if len(between) < 2:
        return None
    xs, ys = [x for x, _ in between], [y for _, y in between]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in between) / sum((x - mx) ** 2 for x in xs)
    offset = slope * mx - my  # s = slope / wavelength - offset
    if slope <= 0 or offset <= 0:
        return None
    rope = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0 + 1.0 / offset,
            "original_max_position_embeddings": round(slope / offset), "rope_theta": theta}
    context, high = rope["original_max_position_embeddings"], rope["high_freq_factor"]
    for w, d in zip(wavelengths, divisors, strict=True):
        if w < context / high:
            expected = 1.0
        elif w > context:
            expected = factor
        else:
            s = (context / w - 1.0) / (high - 1.0)
            expected = 1.0 / ((1 - s) / factor + s)
        if abs(expected - d) > 1e-3 * d:
            return None
    return rope


# GGUF value types (gguf.GGUFValueType): fixed-size scalars by struct format
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGML_FLOATS = {0: "f", 1: "e"}  # ggml types F32, F16: struct formats


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata (scalars and strings; an array as its length) and its tensors'
    table: name -> (ggml type, shape as ggml lists it, offset in the data section)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, tuple[int, tuple[int, ...], int]]
    data_start: int

    def f32(self, name: str) -> list[float]:
        """A small float tensor's values (the RoPE factor tensors llama.cpp writes)."""
        kind, shape, offset = self.tensors[name]
        count = math.prod(shape)
        if kind not in _GGML_FLOATS:  # llama.cpp keeps these in float32
            raise ValueError(f"{self.path}: tensor {name} is of ggml type {kind}, not a float")
        size = struct.calcsize(_GGML_FLOATS[kind])
        with open(self.path, "rb") as file:
            file.seek(self.data_start + offset)
            data = file.read(size * count)
        return [float(v) for v in struct.unpack(f"<{count}{_GGML_FLOATS[kind]}", data)]


def read_gguf_header(path: Path) -> GgufHeader:
    """A GGUF file's header, read without its tensors: milliseconds where the `gguf` package's
    reader takes seconds over a 150k-token vocabulary. ValueError for what it does not parse
    (a truncated file, GGUF v1, a big-endian file)."""
    try:
        return _read_gguf_header(path)
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def _read_gguf_header(path: Path) -> GgufHeader:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (little-endian v2 and v3 are read)")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", buf, at)
            if at + 8 + length > len(buf):
                raise ValueError("truncated GGUF header")
            return buf[at + 8 : at + 8 + length].decode("utf-8", "replace"), at + 8 + length

        def value(kind: int, at: int) -> tuple[Any, int]:
            if kind == _GGUF_STRING:
                return string(at)
            if kind == _GGUF_ARRAY:
                item_kind, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item_kind in _GGUF_SCALARS:
                    return count, at + count * struct.calcsize(_GGUF_SCALARS[item_kind])
                for _ in range(count):
                    _, at = value(item_kind, at)
                return count, at
            if kind not in _GGUF_SCALARS:
                raise ValueError(f"unknown GGUF value type {kind}")
            return struct.unpack_from(_GGUF_SCALARS[kind], buf, at)[0], at + struct.calcsize(
                _GGUF_SCALARS[kind])

        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = value(kind, pos + 4)
        tensors: dict[str, tuple[int, tuple[int, ...], int]] = {}
        for _ in range(tensor_count):
            name, pos = string(pos)
            (dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
            tensors[name] = (kind, tuple(shape), offset)
            pos += 4 + 8 * dims + 12
    align = int(metadata.get("general.alignment", 32))
    return GgufHeader(path, metadata, tensors, -(-pos // align) * align)
