"""The vector index: which entry wins, removal, scopes, and the SimHash path for big scopes."""

from __future__ import annotations

import numpy as np
import pytest

from caching.index import Match, Partition, VectorIndex, hamming_radius, simhash, unit

DIM = 8


def e(i: int, dim: int = DIM) -> np.ndarray:
    v = np.zeros(dim, dtype=np.float32)
    v[i] = 1.0
    return v


def near(base: np.ndarray, other: np.ndarray, cos: float) -> np.ndarray:
    """A unit vector at cosine `cos` to unit `base`, leaning towards `other` (orthogonal)."""
    return (cos * base + np.sqrt(1 - cos * cos) * other).astype(np.float32)


def test_best_match_wins_with_its_cosine() -> None:
    index = VectorIndex(DIM)
    index.add("s", "x", e(0))
    index.add("s", "y", near(e(0), e(1), 0.6))
    index.add("s", "z", e(2))
    query = near(e(0), e(3), 0.9)
    found = index.search("s", query, threshold=0.5, k=3)
    assert [m.entry_id for m in found] == ["x", "y"]
    assert found[0].similarity == pytest.approx(0.9, abs=1e-6)
    assert found[1].similarity == pytest.approx(0.54, abs=1e-6)
    assert index.search("s", query, threshold=0.95) == []
    assert index.search("s", query, threshold=0.9 - 1e-6) == [Match("x", found[0].similarity)]


def test_ties_go_to_the_older_entry_and_k_limits() -> None:
    index = VectorIndex(DIM)
    for name in ("first", "second", "third"):
        index.add("s", name, e(4))
    assert [m.entry_id for m in index.search("s", e(4), k=2)] == ["first", "second"]


def test_vectors_are_normalised() -> None:
    index = VectorIndex(DIM)
    index.add("s", "x", 5 * e(1))
    (match,) = index.search("s", 0.1 * e(1))
    assert match.similarity == pytest.approx(1.0)


def test_scopes_are_separate() -> None:
    index = VectorIndex(DIM)
    index.add("scope-a", "x", e(0))
    assert index.search("scope-b", e(0)) == []
    index.add("scope-b", "y", near(e(0), e(1), 0.5))
    assert [m.entry_id for m in index.search("scope-b", e(0))] == ["y"]
    assert [m.entry_id for m in index.search("scope-a", e(0))] == ["x"]


def test_remove_and_replace() -> None:
    index = VectorIndex(DIM)
    index.add("s", "x", e(0))
    index.add("s", "y", near(e(0), e(1), 0.8))
    assert index.remove("x") is True
    assert index.remove("x") is False
    assert [m.entry_id for m in index.search("s", e(0))] == ["y"]
    index.add("other", "y", e(0))  # the same id elsewhere moves it
    assert index.search("s", e(0)) == []
    assert index.scope_size("s") == 0 and len(index) == 1 and "y" in index


def test_compaction_keeps_the_live_rows_findable() -> None:
    index = VectorIndex(DIM)
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((200, DIM)).astype(np.float32)
    index.add_many("s", [f"v{i}" for i in range(200)], vectors)
    for i in range(150):  # past a quarter dead: compacts, several times
        index.remove(f"v{i}")
    for i in range(150, 200):
        (best,) = index.search("s", vectors[i])
        assert best.entry_id == f"v{i}" and best.similarity == pytest.approx(1.0, abs=1e-5)
    assert index.search("s", vectors[0], threshold=0.999) == []


def test_bad_vectors_are_refused() -> None:
    index = VectorIndex(DIM)
    with pytest.raises(ValueError):
        index.add("s", "x", np.zeros(DIM))
    with pytest.raises(ValueError):
        index.add("s", "x", np.ones(DIM + 1))
    with pytest.raises(ValueError):
        index.search("s", np.full(DIM, np.nan))
    with pytest.raises(ValueError):
        index.add_many("s", ["a", "a"], [e(0), e(1)])


def test_hamming_radius_grows_as_the_threshold_falls() -> None:
    assert hamming_radius(1.0) == 0
    assert hamming_radius(0.9) < hamming_radius(0.8) < hamming_radius(0.5) < 256
    # codes of a vector and its negation differ in every bit
    v = unit(np.arange(1, 385, dtype=np.float32), 384)
    a, b = simhash(v[None, :]), simhash(-v[None, :])
    assert int(np.unpackbits(a ^ b).sum()) == 512


def random_units(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def queries_near(x: np.ndarray, rows: np.ndarray, cos: float, seed: int) -> np.ndarray:
    """One query per row at cosine `cos` to it (a paraphrase among random questions)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((len(rows), x.shape[1])).astype(np.float32)
    base = x[rows]
    z -= (z * base).sum(1, keepdims=True) * base
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    return (cos * base + np.sqrt(1 - cos * cos) * z).astype(np.float32)


@pytest.mark.parametrize("cos", [0.8, 0.9])
def test_large_partition_agrees_with_brute_force(cos: float) -> None:
    dim, n = 384, 3000
    x = random_units(n, dim, seed=2)
    ids = [f"r{i}" for i in range(n)]
    fast = Partition(dim, exact_max_rows=500)
    exact = Partition(dim, exact_max_rows=10 * n)
    fast.add(ids, x)
    exact.add(ids, x)
    rows = np.arange(0, n, 40)
    queries = queries_near(x, rows, cos, seed=3)
    threshold = cos - 0.05
    for row, query in zip(rows, queries, strict=True):
        got, want = fast.search(query, threshold, 3), exact.search(query, threshold, 3)
        assert [m.entry_id for m in got] == [m.entry_id for m in want]
        assert [m.similarity for m in got] == pytest.approx([m.similarity for m in want])
        assert got[0].entry_id == f"r{row}"
    assert fast._binary is not None and exact._binary is None  # each took its own path


def test_large_partition_removal_and_late_additions() -> None:
    dim, n = 384, 2000
    x = random_units(n + 10, dim, seed=4)
    part = Partition(dim, exact_max_rows=100)
    part.add([f"r{i}" for i in range(n)], x[:n])
    assert part.search(x[7], 0.9, 1)[0].entry_id == "r7"  # builds the Hamming index
    part.remove("r7")
    assert part.search(x[7], 0.9, 1) == []
    part.add([f"late{i}" for i in range(10)], x[n:])  # appended after the index was built
    assert part.search(x[n + 3], 0.9, 1)[0].entry_id == "late3"
    for i in range(600):  # compaction drops the Hamming index; it is rebuilt on demand
        part.remove(f"r{i + 100}")
    assert part.search(x[1500], 0.9, 1)[0].entry_id == "r1500"
    assert part.search(x[150], 0.9, 1) == []
    assert len(part) == n + 10 - 601


def test_low_thresholds_fall_back_to_exact_search() -> None:
    dim, n = 384, 1000
    x = random_units(n, dim, seed=5)
    part = Partition(dim, exact_max_rows=100)
    part.add([f"r{i}" for i in range(n)], x)
    query = random_units(1, dim, seed=6)[0]
    best = int(np.argmax(x @ query))
    assert part.search(query, -1.0, 1)[0].entry_id == f"r{best}"
