"""A stand-in for `CudaGraph` on CPU, for tests only: CUDA cannot be reached here.

A real graph records the device work of one run of the forward and replays exactly that, on
what the buffers hold at replay. This double runs the forward again at every replay, so it
adds two checks for what a real graph would silently get wrong: the replay must take the
same ops on the same shapes as the capture (a branch on a step's values, or a shape that
follows them, would be frozen in a real graph), and no op may wait for the device or bring
values in from the host (`HOST_SYNC_OPS`; under a real capture these fail or are baked in).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# .item(), bool(tensor) and int(tensor), a tensor made from Python values, and ops whose
# output size depends on values (on CUDA they copy a count back to the host)
HOST_SYNC_OPS = frozenset({"item", "_local_scalar_dense", "is_nonzero", "lift_fresh",
                           "nonzero", "masked_select", "bincount", "unique", "_unique2"})

Op = tuple[str, tuple[tuple[int, ...], ...]]


class _Trace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor))
        self.ops.append((func.overloadpacket.__name__, shapes))
        return func(*args, **(kwargs or {}))


def traced(forward: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[Op]]:
    trace = _Trace()
    with trace:
        out = forward()
    return out, trace.ops


class RecordingGraph:
    """Records its capture and its replays; see the module's text."""

    def __init__(self) -> None:
        self.forward: Callable[[], torch.Tensor] | None = None
        self.output: torch.Tensor | None = None
        self.ops: list[Op] = []
        self.replays = 0

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        assert self.forward is None, "a graph is captured once"
        self.output, self.ops = traced(forward)
        self.forward = forward
        self.check_no_host_sync(self.ops)
        return self.output

    def replay(self) -> None:
        assert self.forward is not None and self.output is not None, "replay before capture"
        out, ops = traced(self.forward)
        assert ops == self.ops, ("the replay took other ops or shapes than the capture: "
                                 + _first_difference(self.ops, ops))
        self.output.copy_(out)  # a graph rewrites its captured output in place
        self.replays += 1

    @staticmethod
    def check_no_host_sync(ops: list[Op]) -> None:
        synced = sorted({name for name, _ in ops if name in HOST_SYNC_OPS})
        assert not synced, f"host syncs in the captured forward: {synced}"


def _first_difference(captured: list[Op], replayed: list[Op]) -> str:
    for i, (a, b) in enumerate(zip(captured, replayed, strict=False)):
        if a != b:
            return f"op {i}: captured {a}, replayed {b}"
    return f"{len(captured)} ops captured, {len(replayed)} replayed"
