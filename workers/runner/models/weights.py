"""Copy a HF safetensors checkpoint into a `DecoderModel`, tensor by tensor, by name.

Every checkpoint name maps to one of our parameters, or to rows of one: a module with
`checkpoint_sources()` (attention's q/k/v, the MLP's gate/up, an experts block's experts)
says which of its checkpoint modules land where in its fused ones; a module with
`checkpoint_conversions()` names checkpoint tensors stored in another layout and how each is
turned into its parameter (gpt-oss's stacked, transposed, interleaved experts). Everything
else is the same name without the leading `model.` (and with the family's
`Arch.checkpoint_renames` applied: Mixtral's `block_sparse_moe.` is our `mlp.`). A tensor no
parameter takes, a parameter (or rows of one) no tensor fills, and a tensor of the wrong shape
are each an error naming it. A config quantized with MXFP4 (`mxfp4.py`) stores a tensor `X` as
`X_blocks` and `X_scales`: the pair is read as `X`, dequantized.

Files: the shards `model.safetensors.index.json` lists where there is one, else
`model.safetensors`, else every `*.safetensors` of the folder (a folder may also hold a
checkpoint in another layout, such as Mistral's `consolidated.safetensors`, which only the
index or the standard name tells apart).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers.runner.models import mxfp4

INDEX_FILE = "model.safetensors.index.json"
# checkpoint names that hold no weights: rotary tables some exports save
_IGNORED = (".rotary_emb.inv_freq",)


# How a checkpoint tensor stored in another layout becomes its parameter's layout
Conversion = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor goes: rows [offset, offset + rows) of a parameter (rows
    None: the whole parameter; `_destination` says how rows count in 3-d parameters), after
    `convert` (None: as it is) turns it into the parameter's layout."""

    param: str
    offset: int = 0
    rows: int | None = None
    convert: Conversion | None = None


def checkpoint_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{folder}: shards listed in {INDEX_FILE} are missing: "
                                    f"{', '.join(absent)}")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors files")
    return files


def checkpoint_layout(model: nn.Module) -> dict[str, Slot]:
    """Every checkpoint name the model expects (its `model.` prefix dropped) -> its slot."""
    params = dict(model.named_parameters())
    layout: dict[str, Slot] = {}
    fused: set[str] = set()
    for path, module in model.named_modules():
        sources = getattr(module, "checkpoint_sources", None)
        if sources is None:
            continue
        for source, (target, offset, rows) in sources().items():
            for kind in ("weight", "bias"):
                param = f"{path}.{target}.{kind}"
                if param in params:
                    layout[f"{path}.{source}.{kind}"] = Slot(param, offset, rows)
                    fused.add(param)
        conversions = getattr(module, "checkpoint_conversions", None)
        for source, (target, convert) in (conversions() if conversions else {}).items():
            param = f"{path}.{target}"
            if param in params:
                layout[f"{path}.{source}"] = Slot(param, convert=convert)
                fused.add(param)
    for name in params:
        if name not in fused:
            layout[name] = Slot(name)
    return layout


def head_differs_from_embedding(folder: Path) -> bool:
    """Whether the checkpoint keeps an `lm_head.weight` whose values differ from its embedding.
    A config may say the two are tied while its checkpoint says otherwise; transformers then
    serves them untied, and so must the engine to give the same tokens."""
    where: dict[str, Path] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 - safe_open is not a dict
                if name.removeprefix("model.") in ("lm_head.weight", "embed_tokens.weight"):
                    where[name.removeprefix("model.")] = file
    if len(where) < 2:
        return False
    tensors = []
    for key, file in sorted(where.items()):
        with safe_open(str(file), framework="pt") as reader:
            name = key if key in reader.keys() else f"model.{key}"  # noqa: SIM118
            tensors.append(reader.get_tensor(name))
    return not torch.equal(tensors[0], tensors[1])


def load_weights(model: nn.Module, folder: Path) -> None:
    """Fill every parameter of `model` from the checkpoint in `folder`; raise, naming the
    tensor, if the checkpoint misses one, has one the model does not take, or a shape
    differs."""
    params = dict(model.named_parameters())
    layout = checkpoint_layout(model)
    tied = bool(getattr(model, "tie_word_embeddings", False))
    renames = getattr(getattr(model, "arch", None), "checkpoint_renames", ())
    filled: set[str] = set()
    files = checkpoint_files(folder)
    scales = _mxfp4_scales(files) if mxfp4.quant_method(
        getattr(model, "config", None)) == mxfp4.METHOD else {}
    paired = {partner for partner, _ in scales.values()}  # read with their blocks
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            for stored in reader.keys():  # noqa: SIM118 - safe_open is not a dict
                if stored in paired:
                    continue
                name = stored.removesuffix(mxfp4.BLOCKS) if stored in scales else stored
                key = name.removeprefix("model.")
                for theirs, ours in renames:
                    key = key.replace(theirs, ours)
                if key.endswith(_IGNORED):
                    continue
                if key == "lm_head.weight" and tied:
                    # Tied: either name may be the one a checkpoint kept (safetensors dedups).
                    key = "embed_tokens.weight"
                    if key in filled:
                        continue
                slot = layout.get(key)
                if slot is None:
                    raise ValueError(f"checkpoint {folder}: unexpected tensor {name!r} "
                                     f"({file.name}): the model has no such weight")
                tensor = reader.get_tensor(stored)
                if stored in scales:  # straight into the parameter's dtype
                    tensor = _dequantized(folder, stored, tensor, scales[stored],
                                          params[slot.param].dtype)
                shape = tuple(tensor.shape)
                if slot.convert is not None:
                    try:
                        tensor = slot.convert(tensor)
                    except RuntimeError as exc:  # a shape the conversion cannot take
                        raise ValueError(f"checkpoint {folder}: tensor {name!r} of shape "
                                         f"{shape} cannot be read: {exc}") from exc
                dest = _destination(params[slot.param], slot)
                if tuple(tensor.shape) != tuple(dest.shape):
                    layout_note = "" if slot.convert is None else (
                        f" ({tuple(tensor.shape)} in the model's layout)")
                    raise ValueError(f"checkpoint {folder}: tensor {name!r} has shape "
                                     f"{shape}{layout_note}, the model expects "
                                     f"{tuple(dest.shape)}")
                with torch.no_grad():
                    dest.copy_(tensor)
                filled.add(key)
    missing = sorted(set(layout) - filled)
    if missing:
        shown = ", ".join(repr(_hf_name(m, renames)) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint {folder} lacks weights: {shown}{more}")


def _mxfp4_scales(files: list[Path]) -> dict[str, tuple[str, Path]]:
    """Each `X_blocks` tensor of an MXFP4 checkpoint -> its `X_scales` and that one's file
    (a shard may split the pair)."""
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as reader:
            where.update(dict.fromkeys(reader.keys(), file))
    pairs = {}
    for name in where:
        partner = name.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES
        if name.endswith(mxfp4.BLOCKS) and partner in where:
            pairs[name] = (partner, where[partner])
    return pairs


def _dequantized(folder: Path, name: str, blocks: torch.Tensor,
                 scales: tuple[str, Path], dtype: torch.dtype) -> torch.Tensor:
    partner, file = scales
    with safe_open(str(file), framework="pt") as reader:
        try:
            return mxfp4.dequantize(blocks, reader.get_tensor(partner), dtype)
        except ValueError as exc:
            raise ValueError(f"checkpoint {folder}: tensor {name!r}: {exc}") from exc


def _destination(param: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The parameter, or the slot's rows of it; a parameter of three or more dimensions is
    viewed as rows of its last one (experts stacked as [experts, rows, in] take each
    expert's checkpoint matrix at rows `expert * rows_per_expert + ...`)."""
    if slot.rows is None:
        return param
    flat = param if param.dim() <= 2 else param.view(-1, param.shape[-1])
    return flat.narrow(0, slot.offset, slot.rows)


def _hf_name(key: str, renames: tuple[tuple[str, str], ...] = ()) -> str:
    for theirs, ours in renames:
        key = key.replace(ours, theirs)
    return key if key.startswith("lm_head.") else f"model.{key}"
