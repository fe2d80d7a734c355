"""Size and allocate the paged KV pool from a memory budget."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import psutil
import torch

from workers.runner import huge_pages as host_pages
from workers.runner.kv_quant import row_width

logger = logging.getLogger(__name__)

DEFAULT_CPU_FRACTION = 0.2
MAX_DEFAULT_CPU_BYTES = 4 << 30
DEFAULT_GPU_FRACTION = 0.85


@dataclass
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"  # auto: rows in `dtype`; int8: int8 rows with scales

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.kv_cache_dtype == "int8" else self.dtype

    @property
    def row_width(self) -> int:
        return row_width(self.head_dim, self.kv_cache_dtype)

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.storage_dtype).element_size()
        per_token = 2 * self.num_layers * self.num_kv_heads * self.row_width * element
        return per_token * self.block_size


def budget_bytes(device: torch.device, memory: int | None, fraction: float | None) -> int:
    """Bytes for the pool: an explicit size, or a fraction of free memory on the device."""
    if memory is not None:
        return memory
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (fraction if fraction is not None else DEFAULT_GPU_FRACTION))
    available = psutil.virtual_memory().available
    if fraction is not None:
        return int(available * fraction)
    return min(int(available * DEFAULT_CPU_FRACTION), MAX_DEFAULT_CPU_BYTES)


def allocate(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, *, huge_pages: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One K and one V tensor per layer, `[num_blocks, kv_heads, block_size, row]`: row is
    head_dim, or head_dim + 4 int8 elements under `kv_cache_dtype` int8 (`kv_quant`). On CPU
    `huge_pages` maps them in 2 MB pages where Linux offers them (`huge_pages`)."""
    shape = (num_blocks, spec.num_kv_heads, spec.block_size, spec.row_width)

    def zeros() -> torch.Tensor:
        if huge_pages and device.type == "cpu":
            return host_pages.zeros(shape, spec.storage_dtype)
        return torch.zeros(shape, dtype=spec.storage_dtype, device=device)

    caches = [(zeros(), zeros()) for _ in range(spec.num_layers)]
    logger.info(
        "KV cache: %d blocks of %d tokens = %d tokens (%.1f MiB)",
        num_blocks, spec.block_size, num_blocks * spec.block_size,
        num_blocks * spec.bytes_per_block / 2**20,
    )
    return caches


def copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], src: torch.Tensor,
                dst: torch.Tensor) -> None:
    """Copy-on-write: blocks `src` into blocks `dst` (device index tensors), every layer."""
    for k_cache, v_cache in caches:
        k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
        v_cache.index_copy_(0, dst, v_cache.index_select(0, src))
