"""The decoder every family is built from: Llama's, with each known difference a parameter.

One flattened batch over a paged KV pool: RMSNorm, RoPE (with scaling), grouped-query
attention, a gated MLP, tied or separate LM head. q/k/v and gate/up are fused into one matmul
each at load time (a checkpoint that stores them fused, Phi-3, is read as it is). When a step
carries LoRA rows, each projection adds its rows' adapter deltas (`LoRABatch`) right after the
base matmul.

What a family may change (`Arch`, filled by each family module from its config): biases on
q/k/v and o, RMSNorm over each head of q and k, norms that scale by (1 + w), a scaled
embedding, norms after attention and after the MLP too, the MLP's activation, the attention
scale, attention and final logit soft-capping, attention sinks, a sliding window and a RoPE
table per layer, and the MLP itself (`Arch.mlp`: a mixture-of-experts family gives its experts
block; it takes `(x, lora)` and returns the block's output).

Layers pass the residual stream beside their output, so the residual add and the next RMSNorm
are one step; with `elementwise="cpu"` that step, SiLU-and-multiply and RoPE are each one pass
of a C kernel (`cpu_fused`), otherwise PyTorch's ops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from workers.runner import cpu_amx, cpu_fused
from workers.runner.attention import AttentionMetadata, paged_attention, write_kv
from workers.runner.linear import Linear, LinearKernel, onednn_linear, pack_weight
from workers.runner.lora import PACKED, LoRABatch
from workers.runner.rope import RotaryEmbedding, apply_rotary

# A step's rotary inputs: with PyTorch's ops, the cos/sin rows of its positions
# ([tokens, 1, dim / 2] each); with the C kernel, the positions and the whole tables.
Rope = tuple[torch.Tensor, ...]
DEFAULT_ROPE = "default"

# HF's activation names -> the function of the MLP's gate
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class Arch:
    """How a checkpoint's decoder differs from Llama's. `Arch.of(config)` reads what every
    family shares; a family module overrides the rest (`dataclasses.replace`)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    activation: str = "silu"
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE
    norm_offset: float = 0.0  # 1.0: every norm scales by (1 + w) (Gemma)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    sandwich_norms: bool = False  # a norm after attention and one after the MLP too (Gemma 2/3)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh(scores / cap) * cap before the softmax
    final_softcap: float | None = None  # the same on the logits
    # a learned logit per query head (`self_attn.sinks`) in every softmax's denominator,
    # adding no value (gpt-oss)
    attn_sinks: bool = False
    # per layer: its sliding window (a query sees the `window` most recent positions, itself
    # included) or None, and the name of its RoPE table (a key of `ropes`)
    windows: tuple[int | None, ...] = ()
    rope_keys: tuple[str, ...] = ()
    # RoPE table name -> the config's layer type its settings are read under (None: top level)
    ropes: dict[str, str | None] = field(default_factory=lambda: {DEFAULT_ROPE: None})
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused
    max_model_len: int | None = None  # the longest sequence served exactly (None: no limit)
    mlp: Callable[[Arch, int], nn.Module] | None = None  # None: the gated MLP below
    # (checkpoint, ours) name parts: a checkpoint tensor's name with the first replaced by the
    # second is our parameter's (Mixtral's `block_sparse_moe.` is our `mlp.`)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, family: str, config: Any) -> Arch:
        bias = bool(getattr(config, "attention_bias", False))
        layers = config.num_hidden_layers
        return cls(
            family=family,
            hidden_size=config.hidden_size,
            num_layers=layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim_of(config),
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            activation=getattr(config, "hidden_act", None) or "silu",
            windows=(None,) * layers,
            rope_keys=(DEFAULT_ROPE,) * layers,
        )


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """`sliding_window` on the layers `layer_types` calls `sliding_attention`, none on the
    others (Qwen2/3, Gemma 2/3). HF's mask: key j is visible to query i iff
    i - window < j <= i."""
    window = getattr(config, "sliding_window", None)
    return tuple(window if t == "sliding_attention" else None for t in config.layer_types)


def uniform_window(config: Any) -> tuple[int | None, ...]:
    """`sliding_window` (None: none) on every layer (Mistral, Phi-3)."""
    return (getattr(config, "sliding_window", None),) * config.num_hidden_layers


class RMSNorm(nn.Module):
    """`offset` 1.0 scales by (1 + w) in float32, then rounds (Gemma's); 0.0 rounds, then
    scales by w (Llama's)."""

    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.offset = offset
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x32 * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def _scale(self) -> torch.Tensor:
        if not self.offset:
            return self.weight
        return (self.weight.float() + self.offset).to(self.weight.dtype)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """norm(x) of a [tokens, size] tensor, through the C kernel where it is on."""
        if self.fused:
            return cpu_fused.add_rms_norm(None, x.contiguous(), self._scale(), self.eps)
        return self(x)

    def add_norm(self, x: torch.Tensor | None, residual: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x); x None adds nothing. The C kernel updates
        `residual` in place, so the caller must own it."""
        if self.fused:
            return cpu_fused.add_rms_norm(x, residual, self._scale(), self.eps), residual
        if x is not None:
            residual = residual + x
        return self(residual), residual


class Attention(nn.Module):
    def __init__(self, arch: Arch, layer_idx: int, max_model_len: int | None = None) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = arch.num_heads
        self.num_kv_heads = arch.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = self.k_norm = None
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.norm_offset)
        self.scale = arch.attn_scale if arch.attn_scale is not None else self.head_dim**-0.5
        self.fused = False
        self.fused_checkpoint = arch.fused_checkpoint
        window = arch.windows[layer_idx] if arch.windows else None
        if window is not None and max_model_len is not None and max_model_len <= window:
            window = None  # no sequence outgrows it: full attention is the same
        self.window = window
        self.softcap = arch.attn_softcap
        self.sinks = nn.Parameter(torch.zeros(arch.num_heads)) if arch.attn_sinks else None

    def checkpoint_sources(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint module -> (our module, first output row, rows): q/k/v into qkv_proj."""
        if self.fused_checkpoint:
            return {}
        q, kv = self.q_size, self.kv_size
        return {"q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv),
                "v_proj": ("qkv_proj", q + kv, kv)}

    def forward(
        self, rope: Rope, x: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, block_size: int,
        lora: LoRABatch | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(qkv, x, self.layer_idx, "qkv_proj")
        if self.q_norm is not None and self.k_norm is not None:  # per head, before RoPE
            q_size, kv_size, dim = self.q_size, self.kv_size, self.head_dim
            q_heads = qkv[:, :q_size].reshape(-1, dim)
            k_heads = qkv[:, q_size : q_size + kv_size].reshape(-1, dim)
            qkv[:, :q_size] = self.q_norm.norm(q_heads).view(num_tokens, q_size)
            qkv[:, q_size : q_size + kv_size] = self.k_norm.norm(k_heads).view(num_tokens, kv_size)
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
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale, block_size,
                              window=self.window, softcap=self.softcap, sinks=self.sinks)
        out = out.reshape(num_tokens, self.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            lora.apply(projected, out, self.layer_idx, "o_proj")
        return projected


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up one fused matmul."""

    def __init__(self, arch: Arch, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.intermediate = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate, bias=arch.mlp_bias)
        self.down_proj = Linear(self.intermediate, arch.hidden_size, bias=arch.mlp_bias)
        if arch.activation not in ACTIVATIONS:
            raise ValueError(f"{arch.family}: unsupported activation {arch.activation!r} "
                             f"(served: {', '.join(ACTIVATIONS)})")
        self.act = ACTIVATIONS[arch.activation]
        self.fused_checkpoint = arch.fused_checkpoint
        self.fused = False
        self.adapted = True  # False: LoRA leaves it alone (a dense layer of an experts model)

    def checkpoint_sources(self) -> dict[str, tuple[str, int, int]]:
        if self.fused_checkpoint:
            return {}
        n = self.intermediate
        return {"gate_proj": ("gate_up_proj", 0, n), "up_proj": ("gate_up_proj", n, n)}

    def forward(self, x: torch.Tensor, lora: LoRABatch | None) -> torch.Tensor:
        if not self.adapted:
            lora = None
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer_idx, "gate_up_proj")
        if self.fused and self.act is F.silu:
            hidden = cpu_fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            hidden = self.act(gate) * up
        out = self.down_proj(hidden)
        if lora is not None:
            lora.apply(out, hidden, self.layer_idx, "down_proj")
        return out


class DecoderLayer(nn.Module):
    """Llama: x + attn(norm(x)), then + mlp(norm(.)). With `sandwich_norms` (Gemma 2/3) the
    attention's and the MLP's outputs are normed too before they join the residual stream;
    the checkpoint's names follow each layout (Llama's `post_attention_layernorm` is the norm
    before the MLP, Gemma's the one after attention)."""

    def __init__(self, arch: Arch, layer_idx: int, max_model_len: int | None = None) -> None:
        super().__init__()

        def norm() -> RMSNorm:
            return RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_offset)

        self.rope_key = arch.rope_keys[layer_idx] if arch.rope_keys else DEFAULT_ROPE
        self.input_layernorm = norm()
        self.self_attn = Attention(arch, layer_idx, max_model_len)
        self.post_attention_layernorm = norm()
        self.sandwich = arch.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(arch, layer_idx) if arch.mlp is None else arch.mlp(arch, layer_idx)

    def forward(
        self, rope: Rope, x: torch.Tensor | None, residual: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, block_size: int,
        lora: LoRABatch | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, still to be added to the residual stream (None
        before the first layer, whose residual is the embedding). Returns the same pair."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(rope, h, kv_cache, meta, block_size, lora)
        if not self.sandwich:
            h, residual = self.post_attention_layernorm.add_norm(h, residual)
            return self.mlp(h, lora), residual
        h = self.post_attention_layernorm.norm(h)
        h, residual = self.pre_feedforward_layernorm.add_norm(h, residual)
        return self.post_feedforward_layernorm.norm(self.mlp(h, lora)), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head of any served family (`Arch`)."""

    def __init__(self, config: Any, max_positions: int, arch: Arch | None = None, *,
                 max_model_len: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.arch = arch = arch if arch is not None else Arch.of("llama", config)
        # one table per RoPE setting the layers use; they stay float32
        try:
            self.rotary = nn.ModuleDict({
                key: RotaryEmbedding(config, arch.head_dim, max_positions, layer_type)
                for key, layer_type in arch.ropes.items()})
        except ValueError as exc:
            raise ValueError(f"{arch.family}: {exc}") from exc
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(arch, i, max_model_len) for i in range(arch.num_layers))
        if any(not isinstance(layer.mlp, MLP) for layer in self.layers):
            for layer in self.layers:  # LoRA adapts attention only (`lora_packing`)
                if isinstance(layer.mlp, MLP):
                    layer.mlp.adapted = False
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, arch.norm_offset)
        self.tie_word_embeddings = arch.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.linear_kernel: LinearKernel = F.linear
        self.head_weight: torch.Tensor | None = None  # a tied head's blocked copy, if packed
        self.head_amx: torch.Tensor | None = None  # and its tile-layout copy (`amx`, `dot`)
        self.head_tile_kernel = "amx"
        self.elementwise = "torch"
        # a buffer, so it is rounded to the model's dtype as HF rounds it and lives on its
        # device: made per step, it was a host tensor on the decode path
        self.embed_scale: torch.Tensor | None
        self.register_buffer("embed_scale", None if arch.embed_scale is None
                             else torch.tensor(arch.embed_scale), persistent=False)

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: it sees the whole context), as it attends:
        what `attention.pool_window` reads to give back blocks before every layer's window."""
        return [layer.self_attn.window for layer in self.layers]

    def lora_packing(self) -> dict[str, tuple[str, ...]]:
        """Our fused projections and the peft modules each holds, in output order. A
        checkpoint stored fused (Phi-3) is adapted on its fused modules, as peft names them."""
        packing = {name: (name,) for name in PACKED} if self.arch.fused_checkpoint else dict(
            PACKED)
        if any(not isinstance(layer.mlp, MLP) for layer in self.layers):  # experts: attention
            packing = {k: v for k, v in packing.items() if k in ("qkv_proj", "o_proj")}
        return packing

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
            if isinstance(module, RMSNorm | Attention | MLP) or hasattr(module, "fused"):
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
        for module in self.modules():  # experts blocks: their own packing (`experts.py`)
            if hasattr(module, "pack_experts"):
                module.pack_experts(tiles, upcast=upcast)
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
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        ropes: dict[str, Rope] = {}
        for key, table in self.rotary.items():
            if self.elementwise == "cpu":
                ropes[key] = (positions, table.cos, table.sin)
            else:
                ropes[key] = table.tables(positions)
        x = None
        last = len(self.layers) - 1
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = layer(ropes[layer.rope_key], x, residual, kv_cache, meta, block_size,
                                lora)
            if between_layers is not None and i < last:
                between_layers()
        return self.norm.add_norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits (soft-capped where the family asks)."""
        logits = self._logits(hidden)
        cap = self.arch.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap).mul_(cap)
        return logits

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
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
