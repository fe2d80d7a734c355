"""Per-row masks of allowed tokens, packed 32 tokens to an int32 word (bit i of word j allows
token 32*j + i): the layout xgrammar and llguidance both fill, so the sampler needs neither."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TokenMask:
    """Masks for some of the sampler's rows: `bitmask[k]` applies to `rows[k]`."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill(matchers: list[Any], rows: list[int], vocab_size: int, device: torch.device) -> TokenMask:
    """Ask each row's matcher for its allowed next tokens (CPU work, per constrained row)."""
    bitmask = torch.full((len(matchers), bitmask_words(vocab_size)), -1, dtype=torch.int32)
    for k, matcher in enumerate(matchers):
        matcher.fill_next_token_bitmask(bitmask, k)
    return TokenMask(rows, bitmask.to(device, non_blocking=True))


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab_size] bool (True = allowed)."""
    return ~_disallowed(bitmask, vocab_size)


def _disallowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return (((bitmask.unsqueeze(-1) >> shifts) & 1) == 0).flatten(1)[:, :vocab_size]


def apply(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of `rows` get -inf, in place. Ids past the mask's width (a model
    vocabulary padded beyond the tokenizer's) are disallowed too."""
    vocab = logits.shape[-1]
    banned = _disallowed(bitmask, min(vocab, bitmask.shape[-1] * 32))
    if banned.shape[-1] < vocab:
        pad = torch.ones(len(rows), vocab - banned.shape[-1], dtype=torch.bool,
                         device=banned.device)
        banned = torch.cat([banned, pad], dim=-1)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(banned, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))
