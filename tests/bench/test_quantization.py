"""bench/quantization.py's greedy agreement: token by token, whole requests, first difference."""

from __future__ import annotations

from bench.quantization import agreement


def test_agreement_counts_tokens_requests_and_the_first_difference():
    base = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 0, 7, 8], [0, 9, 9, 9]]
    got = agreement(base, other)
    assert got["token_agreement"] == 10 / 12
    assert got["identical_requests"] == 1 and got["requests"] == 3
    assert got["first_difference_median"] == 1  # sorted firsts: 0, 1, 4
