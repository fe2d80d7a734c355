"""A compact Llama-family decoder over one flattened batch and a paged KV pool.

RMSNorm, RoPE (with scaling), grouped-query attention, SwiGLU, tied or separate LM head.
q/k/v and gate/up are fused into one matmul each at load time. When a step carries LoRA rows,
each projection adds its rows' adapter deltas (`LoRABatch`) right after the base matmul.

Layers pass the residual stream beside their output, so the residual add and the next RMSNorm
are one step; with `elementwise="cpu"` that step, SiLU-and-multiply and RoPE are each one pass
of a C kernel (`cpu_fused`), otherwise PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.runner import cpu_amx, cpu_fused
from workers.runner.attention import AttentionMetadata, paged_attention, write_kv
from workers.runner.linear import Linear, LinearKernel, onednn_linear, pack_weight
from workers.runner.lora import LoRABatch
from workers.runner.rope import RotaryEmbedding, apply_rotary

# A step's rotary inputs: with PyTorch's ops, the cos/sin rows of its positions
# ([tokens, 1, dim / 2] each); with the C kernel, the positions and the whole tables.
Rope = tuple[torch.Tensor, ...]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_norm(self, x: torch.Tensor | None, residual: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None adds nothing. The C kernel updates
        `residual` in place, so the caller must own it."""
        if self.fused:
            return cpu_fused.add_rms_norm(x, residual, self.weight, self.eps), residual
        if x is not None:
            residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias)
        self.scale = self.head_dim**-0.5
        self.fused = False

    def forward(
        self, rope: Rope, x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, block_size: int,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(qkv, x, self.layer_idx, "qkv_proj")
        if self.fused:  # q and k lead each row: rotate them where they lie
            cpu_fused.rope_(qkv, *rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if not self.fused:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        k_cache, v_cache = kv_cache
        if self.fused and k_cache.dtype == qkv.dtype:  # the C copy; an int8 pool quantizes
            cpu_fused.store_kv(qkv, self.q_size, self.num_kv_heads, self.head_dim,
                               meta.write_rows, k_cache, v_cache)
        else:
            write_kv(k_cache, v_cache, k, v, meta.write_rows)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, block_size)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            lora.apply(projected, out, self.layer_idx, "o_proj")
        return projected


class MLP(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}")
        self.fused = False

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up_proj")
        if self.fused:
            hidden = cpu_fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = F.silu(gate) * up
        out = self.down_proj(hidden)
        if lora is not None:
            lora.apply(out, hidden, self.layer_idx, "down_proj")
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_idx)

    def forward(
        self, rope: Rope, x: torch.Tensor | None, residual: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, block_size: int,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, still to be added to the residual stream (None
        before the first layer, whose residual is the embedding). Returns the same pair."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta, block_size, lora)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, max_positions: int) -> None:
        super().__init__()
        self.config = config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.rotary = RotaryEmbedding(config, head_dim, max_positions)  # stays float32
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.linear_kernel: LinearKernel = F.linear
        self.head_weight: torch.Tensor | None = None  # a tied head's blocked copy, if packed
        self.head_amx: torch.Tensor | None = None  # and its tile-layout copy (`amx`, `dot`)
        self.head_tile_kernel = "amx"
        self.elementwise = "torch"

    def use_linear_kernel(self, kernel: LinearKernel) -> None:
        """Route every projection, the LM head included, through `kernel`."""
        self.linear_kernel = kernel
        for module in self.modules():
            if isinstance(module, Linear):
                module.kernel = kernel

    def use_elementwise(self, name: str) -> None:
        """`cpu`: RMSNorm with the residual add, SiLU-and-multiply and RoPE through the C
        kernels (`cpu_fused.pick_elementwise` decides where they run); `torch`: PyTorch's."""
        self.elementwise = name
        for module in self.modules():
            if isinstance(module, RMSNorm | Attention | MLP):
                module.fused = name == "cpu"

    def pack_linears(self, *, tiles: str | None = None, upcast: bool = False) -> None:
        """Replace every projection's weight by its oneDNN-blocked copy (`onednn_packed`).
        A tied LM head reads the embedding, which lookups need dense, so the head gets a
        blocked copy of its own (one more vocabulary x hidden table, as vLLM's CPU build
        keeps): the head matmul at 1-64 rows took 0.51-0.56x of the dense one's time in
        bfloat16 and 0.63-0.97x in float32 on an AMX Xeon (docs/benchmarks.md).

        `tiles` (a `cpu_amx` kernel, `amx` or `dot`): each weight (the tied head's too) also
        gets a copy in AMX's tile layout for matmuls of few rows, read by that kernel; twice
        the weights' memory.

        `upcast` (`onednn_upcast`): the blocked copies, biases and the head's are float32,
        widened from the bfloat16 weights, which are dropped (the embedding stays)."""
        def blocked(weight: torch.Tensor) -> torch.Tensor:
            return pack_weight(weight.float() if upcast else weight)

        for module in self.modules():
            if isinstance(module, Linear):
                if tiles is not None and cpu_amx.packable(module.weight):
                    module.amx_weight = cpu_amx.pack(module.weight)
                    module.tile_kernel = tiles
                module.weight = nn.Parameter(blocked(module.weight), requires_grad=False)
                if upcast and module.bias is not None:
                    module.bias = nn.Parameter(module.bias.float(), requires_grad=False)
        if not hasattr(self, "lm_head"):
            if tiles is not None and cpu_amx.packable(self.embed_tokens.weight):
                self.head_amx = cpu_amx.pack(self.embed_tokens.weight)
                self.head_tile_kernel = tiles
            self.head_weight = blocked(self.embed_tokens.weight)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
        block_size: int, lora: LoRABatch | None = None,
        between_layers: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Final hidden states for every token of the flattened batch. `between_layers` is
        called after every layer but the last: another step may run there (the engine's
        interjections), as nothing of this one lives outside these locals in between."""
        residual = self.embed_tokens(input_ids)
        if self.elementwise == "cpu":
            rope: Rope = (positions, self.rotary.cos, self.rotary.sin)
        else:
            rope = self.rotary.tables(positions)
        x = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(rope, x, residual, kv_cache, meta, block_size, lora)
            if between_layers is not None and i < last:
                between_layers()
        return self.norm.add_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A tied head reads the embedding, unless quantization gave it its own module
        (`quantization.quantize_weights`: the int8 table shared with the embedding)."""
        if hasattr(self, "lm_head"):
            return self.lm_head(hidden).float()
        if self.head_amx is not None and cpu_amx.fits(hidden, self.head_tile_kernel):
            return cpu_amx.amx_linear(hidden, self.head_amx, self.embed_tokens.num_embeddings,
                                      out_dtype=torch.float32, kernel=self.head_tile_kernel)
        weight = self.embed_tokens.weight if self.head_weight is None else self.head_weight
        if weight.dtype != hidden.dtype:  # `onednn_upcast`'s float32 copy: float32 logits
            return onednn_linear(hidden.float(), weight)
        return self.linear_kernel(hidden, weight, None).float()
