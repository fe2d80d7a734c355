"""CUDA graphs for decode steps: captured once per batch-size bucket, replayed every step.

On a GPU a small model's decode step is bound by the host: a dozen kernel launches a layer
from Python (issue 41: about 17 ms a step on an H100 at batch 1, 8 and 32 alike). A CUDA graph
records a step's launches once and replays them with one call. What it reads must be at the
same addresses at every replay, so a step's inputs are first copied into persistent buffers;
and its shapes are fixed when captured, so a batch of n rows replays the graph of the
smallest bucket of at least n rows, the rows past n being padding.

Padding rows are harmless: each reads token 0 at position 0 and writes its K/V into the null
block, a block of the pool that the block manager never hands out, whose one position is the
row's whole context. It computes finite values no real row reads: projections, norms,
attention and the LM head are per row, so real rows' results do not depend on them.

Here: the buckets, the buffers (one set, at the largest bucket's size; each bucket's graph
reads their leading rows), a step's copy into them, the replay and the slice of the output
back to the step's rows. The graph itself is behind `Graph` (`CudaGraph` on CUDA; tests on
CPU pass a double), and what the forward is (the model over the KV pool, with metadata built
over the buffers) is the runner's (`ModelRunner.enable_decode_graphs`). Never run on a GPU
yet (docs/engine.md, "CUDA graphs").
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

# (token id, position, block table) of one decode row
DecodeRow = tuple[int, int, Sequence[int]]


def capture_sizes(max_num_seqs: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """The decode batch sizes to capture, ascending: `sizes` where given, else vLLM's (1, 2,
    4, every 8 up to 256, every 16 after) and `max_num_seqs` itself, so that a full batch has
    a graph too; none above `max_num_seqs`, which no decode batch exceeds."""
    if sizes is None:
        sizes = [1, 2, 4, *range(8, 257, 8), *range(272, max_num_seqs + 1, 16), max_num_seqs]
    return tuple(sorted({size for size in sizes if 1 <= size <= max_num_seqs}))


class Graph(Protocol):
    """A recorded forward: captured once, then replayed on what the buffers hold."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Record `forward`'s device work; its output, which each replay rewrites in place."""
        ...

    def replay(self) -> None:
        ...


class CudaGraph:
    """`torch.cuda.CUDAGraph` as a `Graph`. Warmed up on a side stream first: Triton compiles
    its kernels and cuBLAS picks its algorithms on a first call, and neither may happen
    while the stream is being captured. Graphs of one runner share a memory pool, captured
    largest first, so the smaller ones reuse its intermediate buffers."""

    WARMUP_RUNS = 2

    def __init__(self, pool: Any) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP_RUNS):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = forward()
        return out

    def replay(self) -> None:
        self.graph.replay()


def cuda_graph_factory() -> Callable[[], Graph]:
    """New `CudaGraph`s sharing one memory pool."""
    pool = torch.cuda.graph_pool_handle()
    return lambda: CudaGraph(pool)


@dataclass(frozen=True)
class StepViews:
    """One bucket's views of the device buffers: all its graph's forward may read."""

    token_ids: torch.Tensor  # int64 [rows]
    positions: torch.Tensor  # int64 [rows]
    slots: torch.Tensor  # int64 [rows]: the pool slot each row's new K/V goes to
    seq_lens: torch.Tensor  # int32 [rows]: each row's context, its new token included
    block_tables: torch.Tensor  # int32 [rows, max_blocks]


class DecodeBuffers:
    """The persistent device tensors every graph reads, and host twins (pinned on CUDA) that
    a step fills before two copies: int64 `[ids | positions | slots]` and int32
    `[seq_lens | block tables]`, each `max_rows` long (tables `max_rows x max_blocks`).
    Allocated once: a step writes into them and allocates nothing on the device."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.max_rows, self.max_blocks, self.device = max_rows, max_blocks, device
        self.host_long = torch.zeros(3 * max_rows, dtype=torch.long, pin_memory=pin)
        self.host_int = torch.zeros(max_rows * (1 + max_blocks), dtype=torch.int32,
                                    pin_memory=pin)
        self.dev_long = torch.zeros_like(self.host_long, device=device)
        self.dev_int = torch.zeros_like(self.host_int, device=device)
        longs, ints = self.host_long.numpy(), self.host_int.numpy()
        m = max_rows
        self._ids, self._positions, self._slots = longs[:m], longs[m : 2 * m], longs[2 * m :]
        self._lens, self._tables = ints[:m], ints[m:].reshape(m, max_blocks)
        # set after each copy on CUDA: the host twins are rewritten only once it has run
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def views(self, rows: int) -> StepViews:
        m, w = self.max_rows, self.max_blocks
        return StepViews(
            token_ids=self.dev_long[:rows], positions=self.dev_long[m : m + rows],
            slots=self.dev_long[2 * m : 2 * m + rows], seq_lens=self.dev_int[:rows],
            block_tables=self.dev_int[m : m + rows * w].view(rows, w))

    def fill(self, rows: Sequence[DecodeRow], size: int, block_size: int,
             null_block: int) -> None:
        """Write `rows`, then padding rows up to `size`, into the host twins. A row's table
        past the blocks it reads keeps stale ids: the kernel stops at its length."""
        if self._copied is not None:
            self._copied.synchronize()
        n, bs = len(rows), block_size
        self._ids[:n] = [token for token, _, _ in rows]
        self._positions[:n] = [pos for _, pos, _ in rows]
        self._slots[:n] = [table[pos // bs] * bs + pos % bs for _, pos, table in rows]
        self._lens[:n] = [pos + 1 for _, pos, _ in rows]
        for i, (_, pos, table) in enumerate(rows):
            used = pos // bs + 1
            self._tables[i, :used] = table[:used]
        self._ids[n:size] = 0
        self._positions[n:size] = 0
        self._slots[n:size] = null_block * bs
        self._lens[n:size] = 1
        self._tables[n:size, 0] = null_block

    def upload(self, size: int) -> None:
        """Copy what a `size`-row graph reads to the device, without waiting for it."""
        self.dev_long.copy_(self.host_long, non_blocking=True)
        ints = self.max_rows + size * self.max_blocks
        self.dev_int[:ints].copy_(self.host_int[:ints], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """A runner's decode graphs, one per bucket, over one set of `DecodeBuffers`.

    `forward(views)` is the step's computation over a bucket's views (the runner's model,
    KV pool and metadata), returning `[rows, vocab]` logits; it must read nothing of a step
    but the views and call nothing that waits for the device."""

    def __init__(self, forward: Callable[[StepViews], torch.Tensor], sizes: Sequence[int], *,
                 max_blocks: int, block_size: int, null_block: int, device: torch.device,
                 new_graph: Callable[[], Graph]) -> None:
        if not sizes:
            raise ValueError("decode graphs need at least one batch size")
        self.sizes = tuple(sorted(set(sizes)))
        self.block_size = block_size
        self.null_block = null_block
        self.buffers = DecodeBuffers(self.sizes[-1], max_blocks, device)
        self._forward = forward
        self._new_graph = new_graph
        self._graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.replays: Counter[int] = Counter()  # by bucket

    @property
    def max_rows(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, on padding rows only: a capture's warm-up
        runs really compute, and padding writes nothing but the null block. Under inference
        mode, as steps run (`ModelRunner.execute`): the ops recorded are those a step takes."""
        for size in reversed(self.sizes):
            self.buffers.fill([], size, self.block_size, self.null_block)
            self.buffers.upload(size)
            views = self.buffers.views(size)
            graph = self._new_graph()
            self._graphs[size] = (graph, graph.capture(lambda v=views: self._forward(v)))

    def bucket(self, rows: int) -> int | None:
        """The smallest captured size of at least `rows`; None past the largest."""
        i = bisect.bisect_left(self.sizes, rows)
        return self.sizes[i] if i < len(self.sizes) and rows > 0 else None

    @torch.inference_mode()
    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor:
        """Replay the bucket of `rows`; their logits, `[len(rows), vocab]`, a view of the
        graph's output (valid until the next replay)."""
        size = self.bucket(len(rows))
        if size is None:
            raise ValueError(f"{len(rows)} decode rows: no captured graph (largest "
                             f"{self.max_rows})")
        self.buffers.fill(rows, size, self.block_size, self.null_block)
        self.buffers.upload(size)
        graph, out = self._graphs[size]
        graph.replay()
        self.replays[size] += 1
        return out[: len(rows)]
