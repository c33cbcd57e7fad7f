"""The paged KV cache tensor and how many blocks of it fit in memory.

Layout: ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 1: 0 = K, 1 = V).
Which block belongs to which request is the block manager's business (lora_runner/block_manager.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from lora_runner.device import resolve_device, resolve_dtype

if TYPE_CHECKING:  # lora_runner.model re-exports allocate_kv_cache: a runtime import would be circular
    from lora_runner.model.config import ModelConfig

logger = logging.getLogger(__name__)


def kv_block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype | str) -> int:
    """Bytes one block takes across all layers, K and V."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if dtype == "auto":
        raise ValueError("dtype 'auto' depends on the device: resolve it first with resolve_dtype(dtype, device)")
    itemsize = torch.empty((), dtype=resolve_dtype(dtype, "cpu")).element_size()
    return (model_config.num_layers * 2 * block_size * model_config.num_kv_heads * model_config.head_dim
            * itemsize)


def num_kv_blocks(model_config: ModelConfig, block_size: int, dtype: torch.dtype | str, budget_bytes: int) -> int:
    """How many whole blocks fit in `budget_bytes` (0 when not even one does)."""
    if budget_bytes < 0:
        raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    return int(budget_bytes) // kv_block_bytes(model_config, block_size, dtype)


def allocate_kv_cache(model_config: ModelConfig, num_blocks: int, block_size: int,
                      dtype: torch.dtype | str, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    Zeroed rather than empty so never-written slots hold finite values.
    """
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    shape = (model_config.num_layers, 2, num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
    logger.info("allocating KV cache %s %s on %s (%.1f MiB)", shape, dtype, device,
                num_blocks * kv_block_bytes(model_config, block_size, dtype) / 2**20)
    return torch.zeros(shape, dtype=dtype, device=device)
