"""Segmented LoRA over a mixed batch equals applying each row's adapter on its own."""

from __future__ import annotations

import torch

from workers.lora.adapter import LoRAAdapter, ModuleShape
from workers.runner.lora import NO_ADAPTER, PACKED, LoRABatch, LoRASegments, LoRASlots

# distinct sizes, so a delta landing in the wrong member's columns cannot go unnoticed
SHAPES = {"q_proj": ModuleShape(32, 48), "k_proj": ModuleShape(32, 16),
          "v_proj": ModuleShape(32, 16), "o_proj": ModuleShape(48, 32),
          "gate_proj": ModuleShape(32, 64), "up_proj": ModuleShape(32, 64),
          "down_proj": ModuleShape(64, 32)}


def random_adapter(name: str, rank: int, modules: list[str], seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {(layer, m): (torch.randn(rank, SHAPES[m].in_features, generator=g),
                            torch.randn(SHAPES[m].out_features, rank, generator=g))
               for layer in range(2) for m in modules}
    return LoRAAdapter(name, rank, 1.0, frozenset(modules), weights)


def make_slots(num_slots: int) -> LoRASlots:
    return LoRASlots(num_slots=num_slots, max_rank=16, num_layers=2, shapes=SHAPES,
                     dtype=torch.float32, device=torch.device("cpu"))


def per_row(rows: list[int]) -> LoRASegments:
    """Segments of rows given one slot per row (each row its own chunk)."""
    return LoRASegments.from_lengths([(slot, 1) for slot in rows])


def test_segments_merge_equal_neighbours_and_skip_base_rows():
    expected = ((0, 0, 2), (2, 3, 6), (0, 6, 7), (1, 9, 10))
    assert per_row([0, 0, NO_ADAPTER, 2, 2, 2, 0, NO_ADAPTER, NO_ADAPTER, 1]).runs == expected
    assert LoRASegments.from_lengths(
        [(0, 2), (NO_ADAPTER, 1), (2, 1), (2, 2), (0, 1), (NO_ADAPTER, 2), (1, 1)]
    ).runs == expected
    assert LoRASegments.from_lengths([]).runs == ()
    assert LoRASegments.from_lengths([(NO_ADAPTER, 3)]).runs == ()


def test_mixed_batch_equals_each_row_alone():
    adapters = [random_adapter("r8", 8, ["q_proj", "v_proj", "down_proj", "up_proj"], 1),
                random_adapter("r16", 16, ["q_proj", "k_proj", "o_proj", "gate_proj"], 2),
                random_adapter("r4", 4, ["v_proj"], 3)]
    slots = make_slots(4)
    for slot, adapter in enumerate(adapters):
        slots.load(slot, adapter)
    rows = [0, 0, 1, NO_ADAPTER, 2, 1, 1, NO_ADAPTER, 0]
    segments = per_row(rows)
    for packed, members in PACKED.items():
        in_features = SHAPES[members[0]].in_features
        widths = [SHAPES[m].out_features for m in members]
        x = torch.randn(len(rows), in_features)
        base = torch.randn(len(rows), sum(widths))
        out = slots.apply(base.clone(), x, 1, packed, segments)
        for i, slot in enumerate(rows):
            parts = []
            for module, part in zip(members, base[i].split(widths), strict=True):
                part = part.clone()
                if slot != NO_ADAPTER and (1, module) in adapters[slot].weights:
                    a, b = adapters[slot].weights[(1, module)]
                    part += b @ (a @ x[i])
                parts.append(part)
            torch.testing.assert_close(out[i], torch.cat(parts), rtol=1e-4, atol=1e-4)


def test_reloading_a_slot_leaves_no_trace():
    slots = make_slots(1)
    slots.load(0, random_adapter("big", 16, list(SHAPES), 4))
    small = random_adapter("small", 4, ["q_proj"], 5)
    slots.load(0, small)
    assert slots.slot_names == ["small"]
    x = torch.randn(3, 32)
    out = slots.apply(torch.zeros(3, 96), x, 0, "gate_up_proj", per_row([0] * 3))
    assert torch.count_nonzero(out) == 0  # the old adapter's gate/up are gone
    out = slots.apply(torch.zeros(3, 80), x, 0, "qkv_proj", per_row([0] * 3))
    assert torch.count_nonzero(out[:, 48:]) == 0  # k and v too; q is the new adapter's
    assert torch.count_nonzero(out[:, :48]) > 0


def test_batched_decode_rows_equal_per_segment_matmuls():
    adapters = [random_adapter(f"a{i}", [4, 8, 16][i % 3], list(SHAPES), 10 + i)
                for i in range(4)]
    slots = make_slots(5)
    for slot, adapter in enumerate(adapters):
        slots.load(slot + 1, adapter)  # slot 0 stays empty: the batched range skips nothing
    # decode rows (one row each, sorted by slot, base rows first), then two prefill chunks
    chunks = [(NO_ADAPTER, 1), (1, 1), (1, 1), (2, 1), (4, 1), (4, 1), (4, 1), (3, 6),
              (NO_ADAPTER, 4), (1, 5)]
    batch = LoRABatch.build(slots, chunks, torch.device("cpu"))
    assert batch.batched is not None and (batch.batched.lo, batch.batched.hi) == (1, 5)
    assert batch.batched.width == 3
    assert batch.segments.runs == ((3, 7, 13), (1, 17, 22))
    rows = [slot for slot, n in chunks for _ in range(n)]
    reference = per_row(rows)
    for packed, members in PACKED.items():
        x = torch.randn(len(rows), SHAPES[members[0]].in_features)
        base = torch.randn(len(rows), sum(SHAPES[m].out_features for m in members))
        expected = slots.apply(base.clone(), x, 0, packed, reference)
        torch.testing.assert_close(batch.apply(base.clone(), x, 0, packed), expected)


def test_skewed_decode_rows_fall_back_to_segments():
    slots = make_slots(8)
    chunks = [(0, 1)] * 12 + [(7, 1)]  # padding slots 0..7 to 12 rows would be 96 rows for 13
    batch = LoRABatch.build(slots, chunks, torch.device("cpu"))
    assert batch.batched is None
    assert batch.segments.runs == ((0, 0, 12), (7, 12, 13))
