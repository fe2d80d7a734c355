"""Stable block names and the Bloom summary the gateway routes on."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tests.workers.engine.helpers import make_seq
from workers.engine.block_manager import BlockManager
from workers.engine.prefix_hash import PrefixSummary, block_hash, chain_hashes


def test_names_are_the_same_in_every_process():
    key = (None, (1, 2, 3, 4), "tenant-a", None)
    code = ("from workers.engine.prefix_hash import block_hash;"
            "print(block_hash((None, (1, 2, 3, 4), 'tenant-a', None)))")
    others = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, check=True).stdout.strip()
              for seed in ("1", "2")}
    assert others == {str(block_hash(key))}


def test_salt_adapter_and_parent_change_the_name():
    base = block_hash((None, (1, 2, 3, 4), "a", None))
    assert len({base, block_hash((None, (1, 2, 3, 4), "b", None)),
                block_hash((None, (1, 2, 3, 4), None, None)),
                block_hash((None, (1, 2, 3, 4), "a", 0)),
                block_hash((7, (1, 2, 3, 4), "a", None)),
                block_hash((None, (1, 2, 3, 5), "a", None))}) == 6


def test_chain_hashes_are_what_the_block_manager_registers():
    bm = BlockManager(16, 4, enable_caching=True)
    seq = make_seq(11)
    seq.cache_salt = "t1"
    bm.match_prefix(seq)  # names the prompt's full blocks (a miss: nothing cached yet)
    names = chain_hashes(seq.token_ids, 4, "t1")
    assert len(names) == 2  # 10 // 4 full blocks before the last token
    assert seq.block_hashes == names
    assert bm.summary().cached_blocks(names) == 0


def test_summary_holds_every_name_and_few_others():
    rng = random.Random(0)
    names = [rng.getrandbits(64) for _ in range(2000)]
    summary = PrefixSummary.build(names, 16, capacity=len(names))
    assert all(name in summary for name in names)
    others = [rng.getrandbits(64) for _ in range(20000)]
    false_positives = sum(name in summary for name in others) / len(others)
    assert false_positives < 0.02
    assert len(summary.bits) < 2000 * 2  # about 1.2 bytes a block at 1%


def test_cached_blocks_counts_the_leading_run_only():
    chain = chain_hashes(list(range(1, 42)), 4, "t")  # 10 blocks
    summary = PrefixSummary.build(chain[:6] + chain[7:], 4, capacity=9)
    assert summary.cached_blocks(chain) == 6
    assert summary.cached_blocks(chain_hashes(list(range(1, 42)), 4, "other")) == 0
    assert summary.cached_blocks([]) == 0


def test_json_round_trip_and_malformed_summaries():
    summary = PrefixSummary.build([1, 2, 3], 16, capacity=3)
    again = PrefixSummary.from_json(summary.to_json())
    assert again == summary and 2 in again
    for bad in ({}, {"block_size": 16, "num_bits": 64, "num_hashes": 3, "bits": "!!"},
                {**summary.to_json(), "num_bits": 8000},
                {**summary.to_json(), "num_hashes": 0},
                {**summary.to_json(), "block_size": "x"}):
        with pytest.raises(ValueError, match="malformed prefix summary"):
            PrefixSummary.from_json(bad)
