"""A mixture-of-experts block in place of the MLP (`Arch.mlp`): a router picks each token's
top-k experts, each expert is a gated MLP, and the token's output is the router-weighted sum of
its experts' outputs.

Routing: a softmax over all experts' router logits in float32, the top k of it, renormalised
to sum to 1 where the family asks (`norm_topk_prob`: Qwen3-MoE's setting; Mixtral always).

The experts' weights are stacked, gate and up fused as in the MLP: `gate_up_proj`
[experts, 2 * intermediate, hidden] and `down_proj` [experts, hidden, intermediate]; a
checkpoint's per-expert matrices land in their rows (`checkpoint_sources`, names per family).

The experts run as grouped matmuls: the (token, expert) pairs are sorted by expert, so each
expert's tokens are one contiguous run of rows, and each projection takes every expert's run
whole; never a loop over tokens. `kernel`:
- `vec` (float32 on CPU) and `amx` / `dot` (bfloat16 on CPU with the runner's tile backends):
  the weights packed once (`SparseMoE.pack_experts`, replacing the stacked copy), every expert
  of a projection in one C call (`cpu_moe`, `cpu_amx.grouped_linear`);
- `grouped`: PyTorch's `_grouped_mm` over the stacked weights (on CPU, PyTorch's own loop of one
  matmul per expert);
- `loop`: one matmul per expert that has tokens, over a view of its stacked weight;
- `auto` (unpacked weights): `grouped` where this PyTorch runs it for the device and dtype (a
  trial, once), else `loop`.
Each token's pairs are then summed back, weighted by the router: in one C pass with the
element-wise kernels on (`cpu_fused.moe_sum`), else a gather and one batched matmul. A layer's
intermediate tensors live in per-thread buffers reused by every layer (`scratch`).

Not served on the experts (refused by name, never silently skipped): LoRA (an adapter may
target attention only: `DecoderModel.lora_packing`) and int8 weights.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.runner import cpu_amx, cpu_fused, cpu_moe
from workers.runner.linear import Linear, LinearKernel
from workers.runner.lora import LoRABatch
from workers.runner.models.layers import ACTIVATIONS, Arch

EXPERT_KERNELS = ("auto", "grouped", "loop")
# kernels over weights `SparseMoE.pack_experts` packed: float32 blocks, bfloat16 tiles
PACKED_KERNELS = ("vec", *cpu_amx.KERNELS)
# Below this many pairs per expert on average, AMX's tiles (16 rows each) sit mostly empty and
# AVX-512 BF16 dot products over the same packed weights were faster: 0.91x AMX's time at 1
# and 8 tokens of 8 per token over 64 experts, 1.44x at 64 (bench/moe_experts.py).
FEW_ROWS = 2


@dataclass(frozen=True)
class ExpertNames:
    """A checkpoint's names for one expert's matrices, under `experts.<index>.`."""

    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"


MIXTRAL_NAMES = ExpertNames(gate="w1", up="w3", down="w2")


class Stacked(nn.Module):
    """One weight per expert, stacked: `weight` [experts, rows, in]; with `bias`, one bias
    per expert too, `bias` [experts, rows] (gpt-oss)."""

    def __init__(self, experts: int, rows: int, columns: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, rows, columns))
        self.bias = nn.Parameter(torch.empty(experts, rows)) if bias else None


class Experts(nn.Module):
    """The experts' stacked weights and the routed matmuls over them."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 names: ExpertNames, bias: bool = False) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden = hidden
        self.intermediate = intermediate
        self.names = names
        self.gate_up_proj = Stacked(num_experts, 2 * intermediate, hidden, bias)
        self.down_proj = Stacked(num_experts, hidden, intermediate, bias)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up bias [experts, 2 * intermediate], down bias [experts, hidden]), or None."""
        gate_up, down = self.gate_up_proj.bias, self.down_proj.bias
        return None if gate_up is None or down is None else (gate_up, down)

    def checkpoint_sources(self) -> dict[str, tuple[str, int, int]]:
        """`<e>.gate`/`<e>.up` into expert e's rows of gate_up_proj, `<e>.down` into its
        rows of down_proj (3-d parameters count rows of their last dimension)."""
        n, h, names = self.intermediate, self.hidden, self.names
        sources: dict[str, tuple[str, int, int]] = {}
        for e in range(self.num_experts):
            sources[f"{e}.{names.gate}"] = ("gate_up_proj", 2 * n * e, n)
            sources[f"{e}.{names.up}"] = ("gate_up_proj", 2 * n * e + n, n)
            sources[f"{e}.{names.down}"] = ("down_proj", h * e, h)
        return sources


class SparseMoE(nn.Module):
    """Router (`gate`, hidden -> experts) and `experts`; forward takes `(x, lora)` like the
    MLP. `round_weights`: the router's weights are rounded to the model dtype before they scale
    the experts' outputs (Qwen3-MoE); otherwise they scale in float32 (Mixtral). `bias`: the
    router and every expert's projections have biases (gpt-oss). A family whose checkpoint
    lays the experts out otherwise names its `Experts` subclass in `experts_type`."""

    quantizable = False  # int8 weights are refused by name (`quantization.check_quantizable`)
    experts_type: type[Experts] = Experts

    def __init__(self, arch: Arch, layer_idx: int, *, num_experts: int, top_k: int,
                 intermediate: int, norm_topk_prob: bool, names: ExpertNames = ExpertNames(),
                 round_weights: bool = True, bias: bool = False) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"{arch.family}: num_experts_per_tok {top_k} must be in "
                             f"1..{num_experts}")
        if arch.activation not in ACTIVATIONS:
            raise ValueError(f"{arch.family}: unsupported activation {arch.activation!r} "
                             f"(served: {', '.join(ACTIVATIONS)})")
        self.family = arch.family
        self.layer_idx = layer_idx
        self.num_experts = num_experts
        self.top_k = top_k
        self.intermediate = intermediate
        self.norm_topk_prob = norm_topk_prob
        self.round_weights = round_weights
        self.act = ACTIVATIONS[arch.activation]
        self.gate = Linear(arch.hidden_size, num_experts, bias=bias)
        self.experts = self.experts_type(num_experts, arch.hidden_size, intermediate, names,
                                         bias)
        self.kernel = "auto"  # EXPERT_KERNELS
        self.fused = False  # SiLU-and-multiply through the C kernel (`use_elementwise`)
        self.tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # `pack_experts`
        # below FEW_ROWS (token, expert) pairs per expert on average, this kernel instead
        self.few_rows_kernel: str | None = None
        self.upcast = False  # bfloat16 activations through float32 experts (`pack_experts`)

    def pack_experts(self, tiles: str | None, *, upcast: bool = False) -> None:
        """Pack the experts' weights once for a kernel that takes every expert of a projection
        in one call; the packed copy replaces the stacked one. bfloat16 with a `cpu_amx` tile
        kernel (`amx`, `dot`: the runner's bfloat16 tile backends): its tile layout; float32
        on CPU: `cpu_moe`'s 16-column blocks (`vec`). `upcast` (the `onednn_upcast` linear
        backend: a CPU without bfloat16 dot products) widens bfloat16 experts to float32 once
        for `vec`; the block then runs in float32 and rounds its output to bfloat16 once, where
        PyTorch's bfloat16 matmuls on such a CPU are emulated. Otherwise, or where the sizes
        do not fit the layout, the stacked weights stay (`auto`: PyTorch's grouped matmul)."""
        gate_up, down = self.experts.gate_up_proj.weight, self.experts.down_proj.weight
        if upcast and gate_up.dtype == torch.bfloat16:
            gate_up, down = gate_up.float(), down.float()
        if gate_up.dtype == torch.bfloat16 and tiles is not None:
            if not (cpu_amx.packable(gate_up[0]) and cpu_amx.packable(down[0])
                    and cpu_amx.kernel_available(tiles)):
                return
            self.tiles = (cpu_amx.pack_experts(gate_up), cpu_amx.pack_experts(down))
            self.kernel = tiles
            if tiles == "amx" and cpu_amx.kernel_available("dot"):
                self.few_rows_kernel = "dot"  # the same layout
        elif cpu_moe.packable(gate_up) and cpu_moe.packable(down) and cpu_moe.available():
            self.tiles = (cpu_moe.pack_experts(gate_up), cpu_moe.pack_experts(down))
            self.kernel = "vec"
            self.upcast = upcast and self.experts.gate_up_proj.weight.dtype == torch.bfloat16
        else:
            return
        # buffers, so the model's weight bytes (`quantization.weight_bytes`) count them
        self.register_buffer("gate_up_packed", self.tiles[0], persistent=False)
        self.register_buffer("down_packed", self.tiles[1], persistent=False)
        for stacked in (self.experts.gate_up_proj, self.experts.down_proj):
            stacked.weight = nn.Parameter(stacked.weight.new_empty(0), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, experts), each [tokens, top_k]: float32 weights, or in x's dtype where
        `round_weights`."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.round_weights:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        weights, experts = self.route(x)
        kernel = pick_expert_kernel(self.kernel, x)
        if self.few_rows_kernel is not None and experts.numel() < FEW_ROWS * self.num_experts:
            kernel = self.few_rows_kernel
        biases = self.experts.biases()
        if self.upcast:  # float32 experts: widened in, rounded once out
            if biases is not None:
                biases = (biases[0].float(), biases[1].float())
            out = routed_experts(x.float(), weights.float(), experts, (), (), self._activate,
                                 kernel=kernel, tiles=self.tiles, fused=self.fused,
                                 biases=biases)
            return out.to(x.dtype)
        return routed_experts(x, weights, experts, self.experts.gate_up_proj.weight,
                              self.experts.down_proj.weight, self._activate, kernel=kernel,
                              tiles=self.tiles, fused=self.fused, biases=biases)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.fused and self.act is F.silu:
            out = scratch("hidden", gate_up.shape[0], self.intermediate, gate_up)
            return cpu_fused.silu_mul(gate_up, out=out)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.act(gate) * up


class _Workspace(threading.local):
    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}


_workspace = _Workspace()


def scratch(name: str, rows: int, columns: int, like: torch.Tensor) -> torch.Tensor:
    """A [rows, columns] tensor of `like`'s dtype for a layer's intermediate results, reused
    by every layer and step of this thread on CPU, grown on demand: a prefill's pairs are tens
    of megabytes, and fresh pages from the OS for each cost as much as the work on them (a
    gather into a new tensor took 5-10x one into a reused one). Elsewhere, a new tensor."""
    if like.device.type != "cpu":
        return torch.empty(rows, columns, dtype=like.dtype, device=like.device)
    key = (name, like.dtype)
    buf = _workspace.buffers.get(key)
    if buf is None or buf.numel() < rows * columns:
        with torch.inference_mode(False):  # writable under inference mode and outside it
            buf = _workspace.buffers[key] = torch.empty(max(rows * columns, 1), dtype=like.dtype)
    return buf[: rows * columns].view(rows, columns)


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                   gate_up: Sequence[torch.Tensor], down: Sequence[torch.Tensor],
                   activate: Callable[[torch.Tensor], torch.Tensor], *, kernel: str = "loop",
                   linear: LinearKernel = F.linear,
                   tiles: tuple[torch.Tensor, torch.Tensor] | None = None,
                   fused: bool = False,
                   biases: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{experts[t, k]}(x[t]) for every token t, where
    expert e(v) = down[e] @ activate(gate_up[e] @ v). `gate_up` [E, 2n, H], `down` [E, H, n]
    (stacked; for `loop`, any sequence of per-expert weights `linear` takes; for the tile
    kernels, `amx` and `dot`, `tiles` holds both packed by `cpu_amx.pack_experts` instead).
    `biases` (gpt-oss): [E, 2n] and [E, H], expert e's added to each projection's output,
    the rows of a run taking their expert's row (one gather per projection).

    The pairs' outputs come out in the experts' order; each token's are gathered back and
    summed, weighted: with `fused` (the C kernels are on), in one pass (`cpu_fused.moe_sum`,
    float32 sums), else by a gather and one batched matmul (a scatter-add, `index_add_`,
    took 10-50x longer on CPU)."""
    tokens, top_k = experts.shape
    hidden_size = x.shape[1]
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)  # pairs by expert; token order within each expert
    num_experts = len(gate_up) if tiles is None else tiles[0].shape[0]
    counts = torch.bincount(flat, minlength=num_experts)
    pairs = flat.numel()
    rows = torch.index_select(x, 0, order // top_k,
                              out=scratch("rows", pairs, hidden_size, x))
    if biases is not None:  # each pair's expert's bias rows; `loop` passes them to `linear`
        by_expert = flat[order]
        gate_up_bias, down_bias = biases
        if kernel != "loop":
            activate = _biased(activate, gate_up_bias.index_select(0, by_expert))
    if kernel in PACKED_KERNELS:
        assert tiles is not None
        offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=offsets[1:])
        width = tiles[0].shape[1] // hidden_size
        gate_up_out = scratch("gate_up", pairs, width, x)
        out = scratch("out", pairs, hidden_size, x)
        if kernel == "vec":
            gated = cpu_moe.grouped_linear(rows, tiles[0], offsets, width, out=gate_up_out)
            out = cpu_moe.grouped_linear(activate(gated), tiles[1], offsets, hidden_size,
                                         out=out)
        else:
            gated = cpu_amx.grouped_linear(rows, tiles[0], offsets, width, kernel=kernel,
                                           out=gate_up_out)
            out = cpu_amx.grouped_linear(activate(gated), tiles[1], offsets, hidden_size,
                                         kernel=kernel, out=out)
    elif kernel == "grouped":
        offsets = counts.cumsum(0, dtype=torch.int32)
        hidden = activate(torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets))
        out = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offsets)
    else:
        out = scratch("out", pairs, hidden_size, x)
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                run = slice(start, start + count)
                bias_in, bias_out = (None, None) if biases is None else (biases[0][e],
                                                                         biases[1][e])
                out[run] = linear(activate(linear(rows[run], gate_up[e], bias_in)), down[e],
                                  bias_out)
                start += count
    if biases is not None and kernel != "loop":
        out.add_(down_bias.index_select(0, by_expert))
    back = torch.empty_like(order)
    back[order] = torch.arange(pairs, device=order.device)
    if fused:
        return cpu_fused.moe_sum(out, back.view(tokens, top_k), weights.float())
    gathered = torch.index_select(out, 0, back, out=scratch("rows", pairs, hidden_size, x))
    gathered = gathered.view(tokens, top_k, hidden_size)
    if weights.dtype == x.dtype:
        return torch.bmm(weights.unsqueeze(1), gathered).squeeze(1)
    # float32 weights (Mixtral): each product in float32, rounded, then summed, as HF does
    return (gathered * weights.unsqueeze(-1)).to(x.dtype).sum(dim=1)


def _biased(activate: Callable[[torch.Tensor], torch.Tensor], bias: torch.Tensor
            ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`activate` of the gate/up projection's output after its pairs' bias rows are added
    (in place: the output is the layer's own buffer)."""
    return lambda gate_up: activate(gate_up.add_(bias))


@functools.cache
def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this PyTorch runs `_grouped_mm` on the device in the dtype, by a tiny trial
    (the op is private; CUDA builds take bfloat16 on recent GPUs only)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(4, 16, dtype=dtype, device=device_type)
        w = torch.ones(2, 16, 16, dtype=dtype, device=device_type)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        out = torch._grouped_mm(x, w, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.all(out == 16).item())


def pick_expert_kernel(name: str, x: torch.Tensor) -> str:
    if name in PACKED_KERNELS:  # packed by `pack_experts`
        return name
    if name not in EXPERT_KERNELS:
        raise ValueError(f"expert kernel must be one of {', '.join(EXPERT_KERNELS)}")
    if name == "auto":
        return "grouped" if grouped_mm_runs(x.device.type, x.dtype) else "loop"
    return name
