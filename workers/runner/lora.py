"""LoRA for mixed batches: every token row applies its own adapter, in one forward pass.

Adapters live in device-resident slots. The model fuses q/k/v and gate/up into one matmul
each, so LoRA follows the same packing: per (layer, fused projection) one stacked A
[slots, members * max_rank, in] (one matmul for all members) and one B [slots, out, max_rank]
per member, zero-padded past each adapter's rank so padding is exact. A step's rows come
grouped by adapter, so rows sharing one form contiguous segments; each segment costs a few
small matmuls added into the base projection's output (a segmented GEMM). Weights are never
merged and the batch is never split.
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
    def from_rows(cls, slots_per_row: list[int]) -> LoRASegments:
        runs: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(slots_per_row) + 1):
            if i == len(slots_per_row) or slots_per_row[i] != slots_per_row[start]:
                if slots_per_row[start] != NO_ADAPTER:
                    runs.append((slots_per_row[start], start, i))
                start = i
        return cls(tuple(runs))

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


@dataclass
class _Member:
    module: str
    offset: int  # first output column in the fused projection
    b: torch.Tensor  # [slots, out, max_rank]


class LoRASlots:
    def __init__(self, *, num_slots: int, max_rank: int, num_layers: int,
                 shapes: dict[str, ModuleShape], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.members: dict[tuple[int, str], list[_Member]] = {}
        for layer in range(num_layers):
            for packed, modules in PACKED.items():
                in_features = shapes[modules[0]].in_features
                self.a[(layer, packed)] = torch.zeros(
                    num_slots, len(modules) * max_rank, in_features, dtype=dtype, device=device)
                offset, members = 0, []
                for module in modules:
                    out = shapes[module].out_features
                    members.append(_Member(module, offset, torch.zeros(
                        num_slots, out, max_rank, dtype=dtype, device=device)))
                    offset += out
                self.members[(layer, packed)] = members
        self.slot_names: list[str | None] = [None] * num_slots
        self._targets: list[frozenset[str]] = [frozenset()] * num_slots

    @property
    def num_bytes(self) -> int:
        tensors = [*self.a.values(), *(m.b for ms in self.members.values() for m in ms)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot; modules it does not target stay zero."""
        self.clear(slot)
        r = adapter.rank
        for (layer, packed), members in self.members.items():
            a = self.a[(layer, packed)]
            for i, member in enumerate(members):
                pair = adapter.weights.get((layer, member.module))
                if pair is not None:
                    a[slot, i * self.max_rank : i * self.max_rank + r].copy_(pair[0])
                    member.b[slot, :, :r].copy_(pair[1])
        self.slot_names[slot] = adapter.name
        self._targets[slot] = adapter.target_modules

    def clear(self, slot: int) -> None:
        for key, a in self.a.items():
            a[slot].zero_()
            for member in self.members[key]:
                member.b[slot].zero_()
        self.slot_names[slot] = None
        self._targets[slot] = frozenset()

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, packed: str,
              segments: LoRASegments) -> torch.Tensor:
        """out[rows] += x[rows] @ A.T @ B.T for each segment's slot; returns `out`."""
        a, members, r = self.a[(layer, packed)], self.members[(layer, packed)], self.max_rank
        for slot, start, end in segments.runs:
            targets = self._targets[slot]
            used = [(i, m) for i, m in enumerate(members) if m.module in targets]
            if not used:
                continue
            shrunk = x[start:end] @ a[slot].T  # [rows, members * max_rank]
            for i, member in used:
                b = member.b[slot]
                out[start:end, member.offset : member.offset + b.shape[0]] += (
                    shrunk[:, i * r : (i + 1) * r] @ b.T)
        return out


@dataclass(frozen=True)
class LoRABatch:
    """What the model needs to apply LoRA in one step: the slots and this step's segments."""

    slots: LoRASlots
    segments: LoRASegments

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, packed: str) -> torch.Tensor:
        return self.slots.apply(out, x, layer, packed, self.segments)
