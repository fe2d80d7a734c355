"""LoRA for mixed batches: every token row applies its own adapter, in one forward pass.

Adapters live in device-resident slots. The model fuses q/k/v and gate/up into one matmul
each, so LoRA follows the same packing: per (layer, fused projection) one stacked A^T
[slots, in, members * max_rank] (one shrink matmul for all members), and per member a B^T
[slots, max_rank, out] whose product lands in that member's columns. Everything is
zero-padded past each adapter's rank, so padding is exact, and stored in the layout the
matmuls read (a transposed view would be copied by every batched matmul on CPU).

A step's rows come ordered by slot (decodes first, then prefill chunks), so rows sharing an
adapter are contiguous. Decode rows go through one batched (BGMV-style) pair of `bmm` over
the slots in use, each slot's rows padded to the widest: a handful of ops per projection
however many adapters the batch mixes. Prefill chunks are long, so each is its own segment
(two matmuls, no padding). Weights are never merged and the batch is never split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.lora.adapter import LoRAAdapter, ModuleShape

NO_ADAPTER = -1

# the model's fused projections and the peft modules each one holds, in output order
PACKED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass(frozen=True)
class LoRASegments:
    """(slot, first row, end row) runs of one step's flattened rows; base rows are left out."""

    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def from_lengths(cls, slot_lengths: list[tuple[int, int]]) -> LoRASegments:
        """From (slot, number of rows) per chunk, in row order; equal neighbours merge."""
        runs: list[tuple[int, int, int]] = []
        row = 0
        for slot, length in slot_lengths:
            if slot != NO_ADAPTER:
                if runs and runs[-1][0] == slot and runs[-1][2] == row:
                    runs[-1] = (slot, runs[-1][1], row + length)
                else:
                    runs.append((slot, row, row + length))
            row += length
        return cls(tuple(runs))


class LoRASlots:
    def __init__(self, *, num_slots: int, max_rank: int, num_layers: int,
                 shapes: dict[str, ModuleShape], dtype: torch.dtype,
                 device: torch.device, packed: dict[str, tuple[str, ...]] | None = None) -> None:
        """`packed`: the model's fused projections and their peft modules (default `PACKED`;
        a checkpoint stored fused, Phi-3, has one module each)."""
        self.packed = PACKED if packed is None else packed
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.a_t: dict[tuple[int, str], torch.Tensor] = {}
        self.b_t: dict[tuple[int, str], torch.Tensor] = {}  # keyed by (layer, member)
        # member -> (index in its fused projection, first output column, output width)
        self.layout: dict[str, tuple[str, int, int, int]] = {}
        for packed, modules in self.packed.items():
            offset = 0
            for i, module in enumerate(modules):
                self.layout[module] = (packed, i, offset, shapes[module].out_features)
                offset += shapes[module].out_features
            for layer in range(num_layers):
                self.a_t[(layer, packed)] = torch.zeros(
                    num_slots, shapes[modules[0]].in_features, len(modules) * max_rank,
                    dtype=dtype, device=device)
                for module in modules:
                    self.b_t[(layer, module)] = torch.zeros(
                        num_slots, max_rank, shapes[module].out_features, dtype=dtype,
                        device=device)
        self.slot_names: list[str | None] = [None] * num_slots
        self.targets: list[frozenset[str]] = [frozenset()] * num_slots

    @property
    def num_bytes(self) -> int:
        tensors = [*self.a_t.values(), *self.b_t.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot; modules it does not target stay zero."""
        self.clear(slot)
        r, width = adapter.rank, self.max_rank
        for (layer, module), (a, b) in adapter.weights.items():
            packed, i, _, _ = self.layout[module]
            cols = slice(i * width, i * width + r)
            self.a_t[(layer, packed)][slot, :, cols].copy_(a.T)
            self.b_t[(layer, module)][slot, :r].copy_(b.T)
        self.slot_names[slot] = adapter.name
        self.targets[slot] = adapter.target_modules

    def clear(self, slot: int) -> None:
        for tensor in [*self.a_t.values(), *self.b_t.values()]:
            tensor[slot].zero_()
        self.slot_names[slot] = None
        self.targets[slot] = frozenset()

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, packed: str,
              segments: LoRASegments) -> torch.Tensor:
        """out[rows] += x[rows] @ A.T @ B.T for each segment's slot; returns `out`."""
        a_t, width = self.a_t[(layer, packed)], self.max_rank
        members = self.packed[packed]
        for slot, start, end in segments.runs:
            targets = self.targets[slot]
            if targets.isdisjoint(members):
                continue
            shrunk = x[start:end] @ a_t[slot]
            for i, module in enumerate(members):
                if module in targets:
                    _, _, offset, size = self.layout[module]
                    out[start:end, offset : offset + size].addmm_(
                        shrunk[:, i * width : (i + 1) * width],
                        self.b_t[(layer, module)][slot])
        return out


@dataclass(frozen=True)
class BatchedRows:
    """Decode rows of slots lo..hi-1, gathered into [hi - lo, width] with padding.

    `gather` picks x rows for every padded position; `valid` are the positions that hold a
    real row and `dest` the rows of `out` they add into."""

    lo: int
    hi: int
    width: int
    gather: torch.Tensor
    valid: torch.Tensor
    dest: torch.Tensor

    @classmethod
    def plan(cls, row_slots: list[int], device: torch.device) -> BatchedRows | None:
        """From the slot of each decode row (sorted by slot); None if padding would more than
        double the work (a skewed batch), in which case per-segment matmuls are cheaper."""
        used = [(row, slot) for row, slot in enumerate(row_slots) if slot != NO_ADAPTER]
        if not used:
            return None
        lo, hi = used[0][1], used[-1][1] + 1
        rows_of: dict[int, list[int]] = {}
        for row, slot in used:
            rows_of.setdefault(slot, []).append(row)
        width = max(len(rows) for rows in rows_of.values())
        if (hi - lo) * width > 2 * len(used) + 8:
            return None
        gather, valid, dest = [], [], []
        for slot in range(lo, hi):
            rows = rows_of.get(slot, [])
            for j in range(width):
                if j < len(rows):
                    valid.append(len(gather))
                    dest.append(rows[j])
                gather.append(rows[j] if j < len(rows) else used[0][0])

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

        return cls(lo, hi, width, tensor(gather), tensor(valid), tensor(dest))


@dataclass(frozen=True)
class LoRABatch:
    """What the model needs to apply LoRA in one step: the slots, the batched decode rows and
    the segments done one by one."""

    slots: LoRASlots
    segments: LoRASegments
    batched: BatchedRows | None = None

    @classmethod
    def build(cls, slots: LoRASlots, chunks: list[tuple[int, int]],
              device: torch.device) -> LoRABatch:
        """`chunks`: (slot, number of rows) in row order, single-row (decode) chunks first."""
        num_single = 0
        while num_single < len(chunks) and chunks[num_single][1] == 1:
            num_single += 1
        batched = BatchedRows.plan([slot for slot, _ in chunks[:num_single]], device)
        rest = chunks if batched is None else (
            [(NO_ADAPTER, num_single), *chunks[num_single:]])
        return cls(slots, LoRASegments.from_lengths(rest), batched)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, packed: str) -> torch.Tensor:
        batched, slots = self.batched, self.slots
        if batched is not None:
            lo, hi, width = batched.lo, batched.hi, slots.max_rank
            xs = x.index_select(0, batched.gather).view(hi - lo, batched.width, -1)
            shrunk = torch.bmm(xs, slots.a_t[(layer, packed)][lo:hi])
            deltas = [torch.bmm(shrunk[:, :, i * width : (i + 1) * width],
                                slots.b_t[(layer, module)][lo:hi])
                      for i, module in enumerate(slots.packed[packed])]
            delta = deltas[0] if len(deltas) == 1 else torch.cat(deltas, dim=-1)
            out.index_add_(0, batched.dest,
                           delta.view(-1, out.shape[-1]).index_select(0, batched.valid))
        return slots.apply(out, x, layer, packed, self.segments)
