"""The paged KV cache tensor and how many blocks of it fit in memory.

Layout: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 1: 0 = K, 1 = V).
Which block belongs to which request is the block manager's business (lora_runner/core/block_manager.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from adapters.sharding import kv_head_range
from lora_runner.device import resolve_device, resolve_dtype
from lora_runner.distributed import SINGLE, TensorParallel

if TYPE_CHECKING:  # lora_runner.model re-exports allocate_kv_cache: a runtime import would be circular
    from lora_runner.model.config import ModelConfig

logger = logging.getLogger(__name__)


def local_kv_heads(model_config: ModelConfig, tp: TensorParallel = SINGLE) -> int:
    """KV heads a rank's cache holds: its share, or 1 (replicated) with fewer KV heads than ranks."""
    start, end = kv_head_range(model_config.num_kv_heads, tp.rank, tp.world_size)
    return end - start


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype | str,
                   tp: TensorParallel = SINGLE) -> int:
    """Bytes one block takes across all layers, K and V (on one rank of ``tp``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if dtype == "auto":
        raise ValueError("dtype 'auto' depends on the device: resolve it first with resolve_dtype(dtype, device)")
    itemsize = torch.empty((), dtype=resolve_dtype(dtype, "cpu")).element_size()
    return (model_config.num_layers * 2 * block_size * local_kv_heads(model_config, tp) * model_config.head_dim
            * itemsize)


def num_kv_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype | str, budget_bytes: int) -> int:
    """How many whole blocks fit in `budget_bytes` (0 when not even one does)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return int(budget_bytes) // kv_block_bytes(model_config, block_size, dtype)


def allocate_kv_cache(model_config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype | str, device: torch.device | str,
                      tp: TensorParallel = SINGLE) -> torch.Tensor:
    """A cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]: zeroed on an
    accelerator, left unwritten on CPU. num_kv_heads is the rank's (local_kv_heads) under ``tp``.

    On CPU nothing touches the memory here, so the OS commits its pages only as blocks are first
    written: start-up costs no time and the process's RSS grows with the blocks in use (the block
    manager hands out the most recently freed blocks first), not with the cache's size. Unwritten
    slots hold whatever the allocator gave (zeros from fresh pages, or reused heap bytes, NaN
    included); attention never lets a slot at or past a sequence's length into a result (the torch
    path selects zeros there with torch.where, the Triton kernels mask their loads), and every slot
    below it was written first. On CUDA it is zeroed as before (device memory is committed at
    allocation anyway).
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    shape = (model_config.num_layers, 2, num_blocks, block_size, local_kv_heads(model_config, tp),
             model_config.head_dim)
    lazy = device.type == "cpu"
    logger.info("allocating KV cache %s %s on %s (%.1f MiB%s)", shape, dtype, device,
                num_blocks * kv_block_bytes(model_config, block_size, dtype, tp) / 2**20,
                ", committed by the OS as blocks are first used" if lazy else "")
    allocate = torch.empty if lazy else torch.zeros
    return allocate(shape, dtype=dtype, device=device)
