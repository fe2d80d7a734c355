"""KV pool sizing from a byte budget or a fraction of free memory."""

from __future__ import annotations

import logging

import psutil
import torch

from workers.runner.kv_cache import KVCacheSpec, allocate, budget_bytes

CPU = torch.device("cpu")


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.float32)
    assert spec.bytes_per_block == 2 * 30 * 3 * 64 * 4 * 16
    half = KVCacheSpec(30, 3, 64, 16, torch.bfloat16)
    assert half.bytes_per_block * 2 == spec.bytes_per_block


def test_budget_is_explicit_bytes_or_a_fraction_of_available_memory():
    assert budget_bytes(CPU, 123_456, None) == 123_456
    available = psutil.virtual_memory().available
    got = budget_bytes(CPU, None, 0.1)
    assert abs(got - available * 0.1) < available * 0.02  # memory moves a little meanwhile
    assert 0 < budget_bytes(CPU, None, None) <= 4 << 30


def test_allocate_makes_one_pool_per_layer_and_logs_token_capacity(caplog):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=8,
                       dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="workers.runner.kv_cache"):
        caches = allocate(spec, num_blocks=5, device=CPU)
    assert len(caches) == 2
    assert all(k.shape == (5, 1, 8, 4) and v.shape == (5, 1, 8, 4) for k, v in caches)
    assert "5 blocks of 8 tokens = 40 tokens" in caplog.text
