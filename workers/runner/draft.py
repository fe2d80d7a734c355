"""Draft-model proposals for speculative decoding: a smaller model of the same vocabulary.

The draft keeps its own paged KV pool with the target's block layout: the same block ids and
block tables, so the scheduler's allocation (and a rolled-back tail) covers both models. Per
sequence it remembers how many positions of its own KV are valid (`computed`); a step first
catches the draft up on the sequence's tokens since then (the whole prompt, the first time:
one variable-length chunk per row), which gives its first proposal, then runs `k - 1`
single-token passes for the rest. After the target's verification, only the positions whose
tokens were kept stay valid (`settle`). A preempted or finished sequence is forgotten, so a
reused block is always recomputed before the draft reads it.

Greedy rows propose the draft's argmax. Sampling rows draw each proposal from the draft's own
sampling distribution `q` (the row's temperature, top-k/top-p, min-p, logit bias), which the
rejection rule needs alongside `p` (`rejection.py`). LoRA rows propose from the base draft:
verification against the adapted target keeps the output exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.scheduler import ScheduledChunk
from workers.runner.attention import GatherWorkspace, build_metadata
from workers.runner.model import LlamaModel
from workers.runner.rejection import draw
from workers.runner.sampler import SamplingRow, apply_logit_bias, select_rows, target_probs


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # [k, vocab] q of sampling rows; None for greedy rows


class DraftProposer:
    def __init__(self, model: LlamaModel, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, attention_backend: str, prefill_attention: str, *,
                 dtype: torch.dtype) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.attention_backend = attention_backend
        self.prefill_attention = prefill_attention
        config = model.config
        self.num_kv_heads = config.num_key_value_heads
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.device = next(model.parameters()).device
        self.dtype = dtype
        self.computed: dict[int, int] = {}  # seq id -> positions of valid draft KV
        self.workspace = GatherWorkspace()

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self.computed.pop(seq_id, None)

    def settle(self, seq_id: int, start_pos: int, num_kept: int) -> None:
        """After verification: the row's last token and its kept proposals are its tokens at
        positions `start_pos .. start_pos + num_kept`; KV past them is stale."""
        if seq_id in self.computed:
            self.computed[seq_id] = min(self.computed[seq_id], start_pos + 1 + num_kept)

    def propose(self, chunks: list[ScheduledChunk], rows: list[SamplingRow]
                ) -> list[Proposal]:
        """`chunk.num_draft_slots` proposals for each chunk (its slots are allocated: the
        last token's position and one per proposal)."""
        # pass 1: each row's tokens since its draft KV ends, through its last token
        pieces = []
        for chunk in chunks:
            assert chunk.context_token_ids is not None
            start = min(self.computed.get(chunk.seq_id, 0), chunk.start_pos)
            pieces.append((start, chunk.context_token_ids[start : chunk.start_pos + 1],
                           chunk.block_table))
        logits = self._forward(pieces)
        tokens: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        self._choose(logits, rows, range(len(chunks)), tokens, probs)
        for step in range(1, max(c.num_draft_slots for c in chunks)):
            live = [i for i, c in enumerate(chunks) if c.num_draft_slots > step]
            if not live:
                break
            logits = self._forward([(chunks[i].start_pos + step, [tokens[i][-1]],
                                     chunks[i].block_table) for i in live])
            self._choose(logits, rows, live, tokens, probs)
        for chunk in chunks:  # written through start_pos + k - 1: the last proposal's input
            self.computed[chunk.seq_id] = chunk.start_pos + chunk.num_draft_slots
        return [Proposal(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs,
                                                                          strict=True)]

    def _choose(self, logits: torch.Tensor, rows: list[SamplingRow], live: range | list[int],
                tokens: list[list[int]], probs: list[list[torch.Tensor]]) -> None:
        live = list(live)
        picked = [rows[i] for i in live]
        apply_logit_bias(logits, picked)
        best = logits.argmax(dim=-1).tolist()
        sampled = [j for j, row in enumerate(picked) if not row.params.greedy]
        q = None
        if sampled:
            q = target_probs(select_rows(logits, sampled), [picked[j].params for j in sampled],
                             normalize=True)
        for j, i in enumerate(live):
            if picked[j].params.greedy:
                tokens[i].append(best[j])
                continue
            assert q is not None
            row_q = q[sampled.index(j)]
            tokens[i].append(draw(row_q, picked[j].generator))
            probs[i].append(row_q)

    def _forward(self, pieces: list[tuple[int, list[int], list[int]]]) -> torch.Tensor:
        """Logits at each piece's last token; single-token pieces go first (decode rows)."""
        order = sorted(range(len(pieces)), key=lambda i: (
            len(pieces[i][1]) != 1, pieces[i][0] if len(pieces[i][1]) == 1 else 0))
        token_ids: list[int] = []
        positions: list[int] = []
        ends = [0] * len(pieces)
        for i in order:
            start, ids, _ = pieces[i]
            token_ids.extend(ids)
            positions.extend(range(start, start + len(ids)))
            ends[i] = len(token_ids) - 1
        meta = build_metadata(
            [(pieces[i][0], len(pieces[i][1]), pieces[i][2]) for i in order],
            self.block_size, self.num_kv_heads, self.group, self.device, self.dtype,
            decode_kernel=None if self.attention_backend == "torch" else self.attention_backend,
            prefill_kernel=self.prefill_attention, workspace=self.workspace,
        )
        hidden = self.model(
            torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
            self.kv_caches, meta, self.block_size)
        index = torch.tensor(ends, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index))
