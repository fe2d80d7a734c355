"""gpt-oss (`GptOssForCausalLM`): Llama's decoder with biases on q/k/v/o, attention sinks (a
learned logit per query head in every softmax's denominator, adding no value), a sliding
window on the layers `layer_types` calls `sliding_attention`, YaRN RoPE, and experts in place
of every MLP:
- the router (`mlp.router`, weight and bias) takes each token's top k logits and a softmax
  over those k only;
- each expert has biases on both projections and a clamped SwiGLU: gate clamped above at
  `swiglu_limit`, up to [-limit, limit], out = (up + 1) * gate * sigmoid(`swiglu_alpha` * gate);
- the checkpoint stacks the experts as x @ W: `gate_up_proj` [experts, hidden, 2 x
  intermediate] with gate and up interleaved (even and odd columns), `gate_up_proj_bias`
  likewise, `down_proj` [experts, intermediate, hidden]; they are turned into `experts.py`'s
  layout (gate rows then up rows, [experts, out, in]) once, at load, so the shared grouped
  kernels run them. MXFP4 experts (`quant_method: mxfp4`, the released checkpoints) are
  dequantized to the model dtype at load (`mxfp4.py`); no other quantization is served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from workers.runner.models import mxfp4
from workers.runner.models.experts import Experts, SparseMoE, scratch
from workers.runner.models.layers import Arch, layer_windows
from workers.runner.models.weights import Conversion


def _gate_then_up(t: torch.Tensor) -> torch.Tensor:
    """Rows (dim 1) gate0, up0, gate1, up1, ... -> gate0, gate1, ..., up0, up1, ..."""
    return t.unflatten(1, (-1, 2)).transpose(1, 2).flatten(1, 2)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)


class StackedExperts(Experts):
    """The experts as the checkpoint stacks them (one tensor per projection and bias), each
    converted to our layout as it is read (`weights.load_weights`)."""

    def checkpoint_sources(self) -> dict[str, tuple[str, int, int]]:
        return {}  # no per-expert tensors

    def checkpoint_conversions(self) -> dict[str, tuple[str, Conversion]]:
        """Checkpoint tensor under this module -> (our parameter under it, its conversion)."""
        return {
            "gate_up_proj": ("gate_up_proj.weight", lambda t: _gate_then_up(_transposed(t))),
            "gate_up_proj_bias": ("gate_up_proj.bias", _gate_then_up),
            "down_proj": ("down_proj.weight", _transposed),
            "down_proj_bias": ("down_proj.bias", lambda t: t),
        }


class ClampedSwiGLUExperts(SparseMoE):
    """gpt-oss's block: top-k router logits, a softmax over those k, then biased experts with
    the clamped SwiGLU."""

    experts_type = StackedExperts

    def __init__(self, arch: Arch, layer_idx: int, *, num_experts: int, top_k: int,
                 intermediate: int, alpha: float, limit: float) -> None:
        super().__init__(arch, layer_idx, num_experts=num_experts, top_k=top_k,
                         intermediate=intermediate, norm_topk_prob=True, bias=True)
        self.alpha = alpha
        self.limit = limit

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top k logits' softmax (in float32, rounded to x's dtype as HF's softmax in that
        dtype rounds) and their experts."""
        top, experts = torch.topk(self.gate(x), self.top_k, dim=-1)
        return torch.softmax(top.float(), dim=-1).to(x.dtype), experts

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        glu = gate * torch.sigmoid(gate * self.alpha)
        out = scratch("hidden", gate_up.shape[0], self.intermediate, gate_up)
        return torch.mul(up.add_(1.0), glu, out=out)


def arch(config: Any) -> Arch:
    method = mxfp4.quant_method(config)
    if method not in (None, mxfp4.METHOD):
        raise ValueError(f"gpt_oss: quantization {method!r} is not served (served: unquantized "
                         f"checkpoints and {mxfp4.METHOD!r} experts, dequantized at load)")
    experts = config.num_local_experts

    def mlp(arch: Arch, layer: int) -> ClampedSwiGLUExperts:
        return ClampedSwiGLUExperts(arch, layer, num_experts=experts,
                                    top_k=config.num_experts_per_tok,
                                    intermediate=config.intermediate_size,
                                    alpha=float(config.swiglu_alpha),
                                    limit=float(config.swiglu_limit))

    return dataclasses.replace(Arch.of("gpt_oss", config), attn_sinks=True,
                               windows=layer_windows(config), mlp=mlp,
                               checkpoint_renames=(("mlp.router.", "mlp.gate."),))
