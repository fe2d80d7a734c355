"""Weight-only int8: every projection, the embedding and the LM head stored as int8 with one
float scale per output channel (symmetric, `w ~ q * scale[:, None]`), a quarter of float32.

The scale factors out of the dot product, `x @ (q * s).T == (x @ q.T) * s`, so a matmul casts
int8 to the activation dtype and scales the output columns afterwards. Measured on a 2-core
AVX2 EPYC (`bench/quantization.py`, docs/benchmarks.md): PyTorch's fused
`_weight_int8pack_mm` is 4-50x slower than oneDNN's float32 matmul at 1-8 rows and worse
beyond (it walks the weight once per row), oneDNN's int8 `qlinear` needs quantized
activations (not weight-only) and this torch has no torchao. So the kernel here casts the
weight (whole, or in equal tiles of at most `CPU_TILE_BYTES`) into one reused float buffer
and hands it to the runner's float matmul (oneDNN on CPU, cuBLAS on CUDA): the weight is
stored and streamed as int8, and each cast is shared by all the rows of the step. The cast
is extra work: it costs where a step is compute-bound and a fused int8 kernel is the fix.

Where the CPU has bfloat16 dot-product instructions (AVX512_BF16 or AMX-BF16) the cast goes to
bfloat16 instead, and the matmul runs there with float32 output (`int8_compute`): every int8
value is exactly a bfloat16, so only the activations are rounded (to 8 significant bits), and
oneDNN's bfloat16 matmul does twice float32's multiply-adds per instruction. On a 2-core Zen 4
EPYC that made a batch-64 step's projections 1.5-2x faster than float32 (docs/benchmarks.md).

Up to `GEMV_ROWS` float32 rows on CPU (decode steps of a few sequences), nothing is cast: a C
kernel (`workers/runner/cpu_int8.py`) reads each weight row as int8, widens it in registers and
multiplies it by every row, in float32. Those steps are bound by reading the weights, which
int8 makes a quarter of float32's bytes: a one-sequence decode step took 0.57x of float32's
time there, where casting had made it 1.9x.

The tied LM head is quantized with the embedding: the head's per-output-channel scales are
the embedding's per-row scales, so one int8 table serves token lookups and logits.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from workers.runner import cpu_int8
from workers.runner.linear import (
    PACKED_BACKENDS,
    Linear,
    LinearKernel,
    linear_kernel,
    native_bf16,
    onednn_runs,
)

QUANTIZATIONS = ("none", "int8")
# What int8 weights are widened to for a matmul: auto (bfloat16 where the CPU multiplies it
# natively and the model is float32, else the model dtype), model, or bfloat16.
INT8_COMPUTE = ("auto", "model", "bfloat16")
# The most bytes of float weight one cast writes on CPU. SmolLM2's layer projections (1-7 MiB
# in float32) are cast whole, which beat 2 MiB tiles 1.15-1.7x at 8-64 rows; the 113 MiB LM
# head goes in equal tiles, which beat one whole cast 1.3-5.4x (bench/quantization.py). CUDA casts
# the whole weight at once (a bandwidth-bound kernel there, not a cache question).
CPU_TILE_BYTES = 8 << 20
# Up to this many float32 rows on CPU, int8 weights are read as int8 by a C kernel
# (workers/runner/cpu_int8.py) instead of cast: a few rows are bound by the weight's bytes.
GEMV_ROWS = 8

_scratch = threading.local()  # one CPU tile buffer per thread: no fresh pages per call


def check_quantization(name: str) -> str:
    if name not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}")
    return name


def check_int8_compute(name: str) -> str:
    if name not in INT8_COMPUTE:
        raise ValueError(f"int8_compute must be one of {', '.join(INT8_COMPUTE)}")
    return name


def pick_int8_compute(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype int8 weights are widened to for matmuls. Asking for bfloat16 where it
    cannot run is an error, not a silent fallback."""
    if check_int8_compute(name) == "model":
        return dtype
    on_cpu = device.type == "cpu"
    if name == "auto":
        if on_cpu and dtype == torch.float32 and native_bf16() and onednn_runs(torch.bfloat16):
            return torch.bfloat16
        return dtype
    if on_cpu and not onednn_runs(torch.bfloat16):
        raise ValueError("int8_compute 'bfloat16' cannot run on this CPU (oneDNN's bfloat16 "
                         "matmul needs AVX-512 or AMX)")
    return torch.bfloat16


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (row): `(q, scale)` with `weight ~ q * scale[:, None]`.

    An all-zero row gets scale 1 (its values are 0 either way)."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None, matmul: LinearKernel = F.linear,
                compute: torch.dtype | None = None) -> torch.Tensor:
    """`F.linear(x, qweight * scale[:, None], bias)`, reading the int8 weight tile by tile;
    the matmul runs in `compute` (x's dtype by default), the result is in x's dtype."""
    dtype = x.dtype
    if x.shape[0] <= GEMV_ROWS and cpu_int8.fits(x) and cpu_int8.available():
        return cpu_int8.int8_gemv(x, qweight, scale, bias)  # read as int8: no cast
    if compute is not None and compute != dtype:
        x = x.to(compute)
    out_features, in_features = qweight.shape
    if x.device.type != "cpu":
        out = matmul(x, qweight.to(x.dtype), None)
    else:
        most = max(64, CPU_TILE_BYTES // (in_features * x.element_size()))
        tiles = -(-out_features // most)
        tile = -(-out_features // tiles)  # equal tiles: no sliver of a last one
        buf = _tile_buffer(tile * in_features, x.dtype)
        parts = []
        for start in range(0, out_features, tile):
            part = qweight[start : start + tile]
            parts.append(matmul(x, buf[: part.numel()].view(part.shape).copy_(part), None))
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    # scaled in float32: a bf16 scale alone is off by up to 0.2% per channel
    out = out.mul_(scale) if out.dtype == torch.float32 else out.float().mul_(scale)
    out = out.to(dtype)
    return out if bias is None else out.add_(bias)


def _tile_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Made outside inference mode, so calls under it and calls outside it may both write
    into it (an inference tensor refuses in-place writes outside inference mode)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        with torch.inference_mode(False):
            buf = _scratch.buf = torch.empty(numel, dtype=dtype)
    return buf


class Int8Linear(nn.Module):
    """A projection whose weight is int8 with per-output-channel scales (buffers, so the
    model's parameters stay the float ones: norms, and anything not quantized)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 matmul: LinearKernel, compute: torch.dtype | None = None) -> None:
        super().__init__()
        self.compute = compute
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.matmul = matmul

    @classmethod
    def from_linear(cls, linear: Linear, matmul: LinearKernel,
                    compute: torch.dtype | None = None) -> Int8Linear:
        q, scale = quantize_per_channel(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls(q, scale, bias, matmul, compute)  # float32 scales, whatever the model dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias, self.matmul, self.compute)


class Int8Embedding(nn.Module):
    """Token embeddings as int8 rows with one scale per token (the tied head's channels)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        q, scale = quantize_per_channel(embedding.weight)
        self.dtype = embedding.weight.dtype
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale)  # float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight[ids].float() * self.scale[ids].unsqueeze(-1)
        return rows.to(self.dtype)


def quantize_weights(model: nn.Module, matmul: LinearKernel,
                     compute: torch.dtype | None = None) -> None:
    """Replace every projection, the embedding and the LM head (tied or not) by int8 ones.

    The float weights are loaded first and dropped here, one module at a time. `matmul` is
    the float kernel each tile goes through (the runner's picked linear backend), in
    `compute` (default: the activations' dtype)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear):
                setattr(parent, name, Int8Linear.from_linear(child, matmul, compute))
    embedding = Int8Embedding(model.embed_tokens)
    model.embed_tokens = embedding
    if model.tie_word_embeddings:  # one int8 table, two uses
        model.lm_head = Int8Linear(embedding.qweight, embedding.scale, None, matmul, compute)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights (parameters and int8 buffers, each storage once); the
    rotary tables, which are a cache of the positions and not weights, are left out."""
    seen: set[int] = set()
    total = 0
    tensors = list(model.parameters())
    tensors += [t for n, t in model.named_buffers() if not n.startswith("rotary.")]
    for tensor in tensors:
        if tensor is None:
            continue
        # a weight blocked for oneDNN (`onednn_packed`) is opaque: no storage to point at
        key = tensor.data_ptr() if tensor.layout == torch.strided else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def check_quantizable(model: nn.Module, quantization: str) -> None:
    """Refuse, naming the family, a quantization some block of the model does not take (a
    module with `quantizable = False`: mixture-of-experts experts); called before the weights
    load."""
    if check_quantization(quantization) == "none":
        return
    refused = {type(m).__name__ for m in model.modules() if getattr(m, "quantizable", True)
               is False}
    if refused:
        family = getattr(getattr(model, "arch", None), "family", type(model).__name__)
        raise ValueError(f"{family}: quantization {quantization!r} is not served on "
                         f"mixture-of-experts experts ({', '.join(sorted(refused))}); use "
                         "quantization 'none'")


def quantize(model: nn.Module, quantization: str, linear_backend: str,
             compute: torch.dtype | None = None) -> None:
    """Apply the engine's `quantization` to a loaded model whose projections already use
    `linear_backend`'s kernel, with matmuls in `compute` (`pick_int8_compute`); `none` leaves
    it as it is."""
    if check_quantization(quantization) == "none":
        return
    check_quantizable(model, quantization)
    if linear_backend in PACKED_BACKENDS:
        raise ValueError(f"linear_backend {linear_backend!r} blocks float weights; with "
                         "quantization 'int8' use auto, onednn or torch")
    quantize_weights(model, linear_kernel(linear_backend), compute)
