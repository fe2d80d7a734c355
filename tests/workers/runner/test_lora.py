"""Segmented LoRA over a mixed batch equals applying each row's adapter on its own."""

from __future__ import annotations

import torch

from workers.lora.adapter import SUPPORTED_MODULES, LoRAAdapter, ModuleShape
from workers.runner.lora import NO_ADAPTER, LoRASegments, LoRASlots

SHAPES = {m: ModuleShape(32, 48) for m in SUPPORTED_MODULES}


def random_adapter(name: str, rank: int, modules: list[str], seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {(layer, m): (torch.randn(rank, 32, generator=g), torch.randn(48, rank, generator=g))
               for layer in range(2) for m in modules}
    return LoRAAdapter(name, rank, 1.0, frozenset(modules), weights)


def test_segments_from_rows():
    rows = [0, 0, NO_ADAPTER, 2, 2, 2, 0, NO_ADAPTER, NO_ADAPTER, 1]
    assert LoRASegments.from_rows(rows).runs == ((0, 0, 2), (2, 3, 6), (0, 6, 7), (1, 9, 10))
    assert LoRASegments.from_rows([]).runs == ()
    assert LoRASegments.from_rows([NO_ADAPTER] * 3).runs == ()


def test_mixed_batch_equals_each_row_alone():
    adapters = [random_adapter("r8", 8, ["q_proj", "down_proj"], 1),
                random_adapter("r16", 16, ["q_proj"], 2),
                random_adapter("r4", 4, ["v_proj"], 3)]
    slots = LoRASlots(num_slots=4, max_rank=16, num_layers=2, shapes=SHAPES,
                      dtype=torch.float32, device=torch.device("cpu"))
    for slot, adapter in enumerate(adapters):
        slots.load(slot, adapter)
    rows = [0, 0, 1, NO_ADAPTER, 2, 1, 1, NO_ADAPTER, 0]
    x = torch.randn(len(rows), 32)
    base = torch.randn(len(rows), 48)
    for module in ("q_proj", "down_proj", "v_proj", "o_proj"):
        out = slots.apply(base.clone(), x, 1, module, LoRASegments.from_rows(rows))
        for i, slot in enumerate(rows):
            expected = base[i].clone()
            if slot != NO_ADAPTER and (1, module) in adapters[slot].weights:
                a, b = adapters[slot].weights[(1, module)]
                expected += b @ (a @ x[i])
            torch.testing.assert_close(out[i], expected, rtol=1e-4, atol=1e-4)


def test_reloading_a_slot_leaves_no_trace():
    slots = LoRASlots(num_slots=1, max_rank=16, num_layers=2, shapes=SHAPES,
                      dtype=torch.float32, device=torch.device("cpu"))
    slots.load(0, random_adapter("big", 16, list(SUPPORTED_MODULES), 4))
    small = random_adapter("small", 4, ["q_proj"], 5)
    slots.load(0, small)
    assert slots.slot_names == ["small"]
    x = torch.randn(3, 32)
    out = slots.apply(torch.zeros(3, 48), x, 0, "k_proj", LoRASegments.from_rows([0, 0, 0]))
    assert torch.count_nonzero(out) == 0  # the old adapter's k_proj is gone
