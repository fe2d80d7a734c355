"""LoRA for mixed batches: every token row applies its own adapter, in one forward pass.

Adapters live in device-resident slots, one stacked A [slots, max_rank, in] and B
[slots, out, max_rank] per (layer, module), zero-padded past each adapter's rank so padding is
exact. A step's rows come grouped by sequence, so rows sharing an adapter form contiguous
segments; each segment is two small matmuls added to the base projection's output (a
segmented GEMM). Weights are never merged and the batch is never split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.lora.adapter import SUPPORTED_MODULES, LoRAAdapter, ModuleShape

NO_ADAPTER = -1


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


class LoRASlots:
    def __init__(self, *, num_slots: int, max_rank: int, num_layers: int,
                 shapes: dict[str, ModuleShape], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for layer in range(num_layers):
            for module in SUPPORTED_MODULES:
                shape = shapes[module]
                self.a[(layer, module)] = torch.zeros(
                    num_slots, max_rank, shape.in_features, dtype=dtype, device=device)
                self.b[(layer, module)] = torch.zeros(
                    num_slots, shape.out_features, max_rank, dtype=dtype, device=device)
        self.slot_names: list[str | None] = [None] * num_slots

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy an adapter into a slot; modules it does not target stay zero."""
        self.clear(slot)
        for key, (a, b) in adapter.weights.items():
            self.a[key][slot, : adapter.rank].copy_(a)
            self.b[key][slot, :, : adapter.rank].copy_(b)
        self.slot_names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        for key in self.a:
            self.a[key][slot].zero_()
            self.b[key][slot].zero_()
        self.slot_names[slot] = None

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, module: str,
              segments: LoRASegments) -> torch.Tensor:
        """out[rows] += x[rows] @ A.T @ B.T for each segment's slot; returns `out`."""
        a, b = self.a[(layer, module)], self.b[(layer, module)]
        for slot, start, end in segments.runs:
            out[start:end] += (x[start:end] @ a[slot].T) @ b[slot].T
        return out
