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

With a sliding window of w positions (query at p sees p - w < j <= p) the queries are taken
w at a time; such a run of m <= w queries at P sees three key ranges, each one flash call with
no mask: its own keys [P, P + m) causally; [P + m - w, P), which every query of the run sees
whole; and the triangle [P - w + 1, P + m - w), where query i sees keys from P + i - w + 1 on:
reversed (queries and keys both) that is top-left causal again, one query short (the run's
last query sees none of it). The parts merge by their log-sum-exps like the two above. Each
query reads at most w keys; nothing before the window is touched.
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
    v_new: torch.Tensor, scale: float, *, window: int | None = None,
) -> torch.Tensor:
    """q, k_new, v_new: the chunk's `[q_len, heads or kv_heads, dim]`; k_ctx, v_ctx: the
    cached context before it, `[kv_heads, context, dim]` (a view is fine). Returns
    `[q_len, heads, dim]`. An empty context gives the chunk's causal attention alone (torch's
    kernel divides by the key count: an empty one stops the process with SIGFPE).

    `window`: query i (position context + i) sees only positions j > context + i - window
    (HF's sliding window: the `window` most recent, its own included)."""
    assert _FLASH is not None, "the fused CPU attention kernel is missing from this torch"
    if window is not None and window < k_ctx.shape[1] + q.shape[0]:
        return _windowed(q, k_ctx, v_ctx, k_new, v_new, scale, window)
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


def _windowed(
    q: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor, k_new: torch.Tensor,
    v_new: torch.Tensor, scale: float, window: int,
) -> torch.Tensor:
    """`cached_chunk_attention` with a window that cuts some query's context: runs of up to
    `window` queries, each as three flash calls merged by log-sum-exp (the module's text)."""
    assert _FLASH is not None
    context, q_len = k_ctx.shape[1], q.shape[0]
    keys = torch.cat([k_ctx, k_new.transpose(0, 1)], dim=1).unsqueeze(0)  # [1, kv, keys, d]
    values = torch.cat([v_ctx, v_new.transpose(0, 1)], dim=1).unsqueeze(0)
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
    outs = []
    for a in range(0, q_len, window):
        m = min(window, q_len - a)
        first = context + a  # the run's first position
        qs = q4[:, :, a : a + m]
        o, lse = _FLASH(qs, keys[:, :, first : first + m], values[:, :, first : first + m],
                        0.0, True, scale=scale)
        parts = [(o, lse)]
        lo = max(first + m - window, 0)
        if lo < first:  # keys every query of the run sees
            parts.append(_FLASH(qs, keys[:, :, lo:first], values[:, :, lo:first], 0.0, False,
                                scale=scale))
        tri = max(first - window + 1, 0)
        if m > 1 and tri < lo:  # the triangle, reversed into top-left causal
            o_t, lse_t = _FLASH(qs[:, :, : m - 1].flip(2), keys[:, :, tri:lo].flip(2),
                                values[:, :, tri:lo].flip(2), 0.0, True, scale=scale)
            # the run's last query sees none of it: weight 0
            parts.append((torch.cat([o_t.flip(2), torch.zeros_like(o[:, :, :1])], dim=2),
                          torch.cat([lse_t.flip(2), torch.full_like(lse[:, :, :1],
                                                                    float("-inf"))], dim=2)))
        outs.append(_merge(parts))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1)


def _merge(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention outputs over disjoint key sets `[1, heads, rows, dim]` and their
    log-sum-exps `[1, heads, rows]` -> the attention over their union."""
    if len(parts) == 1:
        return parts[0][0]
    lses = torch.stack([lse for _, lse in parts])
    total = torch.logsumexp(lses, dim=0)
    out = torch.zeros_like(parts[0][0], dtype=lses.dtype)
    for (o, _), lse in zip(parts, lses, strict=True):
        out.add_(o.to(out.dtype) * torch.exp(lse - total).unsqueeze(-1))
    return out.to(parts[0][0].dtype)
