"""Prefill attention for a chunk that follows cached context, on SDPA's fused CPU kernel.

A chunk at position `p` (after a prefix-cache hit, in a prompt longer than the step budget, or
recomputing a preempted sequence) sees all `p` cached positions and its own tokens causally.
Given that as one explicit `[chunk, p + chunk]` mask, SDPA on CPU falls to its unfused math
path: it materialises the scores per head and runs a separate safe softmax over them (80% of
a 4k-token prefill; docs/engine.md, "Prefill attention").

Here the attention is split at `p` instead. Every query sees the whole cached context, so
that half needs no mask; the chunk's queries and keys start at the same position, so the other
half is plain top-left `is_causal`. Each half is one call of the flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`, what SDPA itself dispatches to), which also
returns each row's log-sum-exp, and the halves merge exactly:
`out = o_new + sigmoid(lse_ctx - lse_new) * (o_ctx - o_new)`. Memory is O(chunk): no mask,
no scores; the kernel takes grouped-query heads as they are, so K/V are never repeated.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Private, so looked up rather than assumed: without it the runner keeps the masked path.
_FLASH: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """Whether this torch has the fused CPU kernel that returns log-sum-exps."""
    return _FLASH is not None


def fits(device: torch.device) -> bool:
    """The kernel is CPU-only; it takes float32, float64, bfloat16 and float16."""
    return device.type == "cpu" and available()


def cached_chunk_attention(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_new: torch.Tensor,
    v_new: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q, k_new, v_new: the chunk's `[q_len, heads or kv_heads, dim]`; k_ctx, v_ctx: the
    cached context before it, `[kv_heads, context, dim]` (a view is fine). Returns
    `[q_len, heads, dim]`. An empty context gives the chunk's causal attention alone (torch's
    kernel divides by the key count: an empty one stops the process with SIGFPE)."""
    assert _FLASH is not None, "the fused CPU attention kernel is missing from this torch"
    q4 = q.transpose(0, 1).unsqueeze(0)
    o_new, lse_new = _FLASH(q4, k_new.transpose(0, 1).unsqueeze(0),
                            v_new.transpose(0, 1).unsqueeze(0), 0.0, True, scale=scale)
    if k_ctx.shape[1] == 0:
        return o_new[0].transpose(0, 1)
    o_ctx, lse_ctx = _FLASH(q4, k_ctx.unsqueeze(0), v_ctx.unsqueeze(0), 0.0, False,
                            scale=scale)
    # The share of each row's softmax mass that lies in the cached context.
    weight = torch.sigmoid(lse_ctx - lse_new).unsqueeze(-1)
    if o_new.dtype == weight.dtype:
        out = o_ctx.sub_(o_new).mul_(weight).add_(o_new)
    else:  # half precision: merge in the log-sum-exps' float32
        new = o_new.float()
        out = o_ctx.float().sub_(new).mul_(weight).add_(new).to(o_new.dtype)
    return out[0].transpose(0, 1)
