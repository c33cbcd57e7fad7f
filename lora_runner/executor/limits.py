"""The runtime sizes derived from an EngineConfig and the model: context length, tokens per step,
KV blocks (on CPU through lora_runner.worker.kv_budget, on CUDA from the start-up memory profile)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from lora_runner.config import EngineConfig
from lora_runner.device import available_host_memory
from lora_runner.worker.kv_budget import check_reserved, host_kv_budget

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048  # default cap of max_model_len on CUDA
_CUDA_KV_FRACTION = 0.8  # default share of free device memory for the KV cache
_CUDA_MAX_CHUNK = 8192  # default cap of max_num_batched_tokens
# smaller on CPU: the torch attention path pads every sequence of a step to its longest chunk and
# context, so a long chunk beside many decodes costs chunk x context x sequences of mask and scores
_CPU_MAX_CHUNK = 2048


@dataclass(frozen=True)
class EngineLimits:
    """Runtime sizes derived from EngineConfig and the model."""

    max_model_len: int
    max_num_batched_tokens: int
    num_kv_blocks: int
    max_blocks_per_seq: int


def step_sizes(config: EngineConfig, max_position_embeddings: int,
               max_model_len: int | None = None) -> tuple[int, int, int]:
    """(max_model_len, max_num_batched_tokens, max_blocks_per_seq) with defaults applied.

    max_model_len: the length decided already (engine_limits() may fit the CPU default to memory);
    None: the setting, or its default (the model's context on CPU, min(2048, it) on CUDA).
    Raises ValueError when max_model_len exceeds the model's max_position_embeddings."""
    if config.max_model_len is not None and config.max_model_len > max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={max_position_embeddings}; lower it")
    if max_model_len is None:
        max_model_len = config.max_model_len or default_max_model_len(config, max_position_embeddings)
    chunk = _CPU_MAX_CHUNK if config.torch_device().type == "cpu" else _CUDA_MAX_CHUNK
    max_batched = config.max_num_batched_tokens or max(min(max_model_len, chunk), config.max_num_seqs)
    return max_model_len, max_batched, -(-max_model_len // config.block_size)


def default_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    if config.torch_device().type == "cpu":
        return max_position_embeddings  # the cache is sized to memory, not to this (host_kv_budget)
    return min(DEFAULT_MAX_MODEL_LEN, max_position_embeddings)


def engine_limits(config: EngineConfig, max_position_embeddings: int, kv_bytes_per_token: int,
           free_device_bytes: int | None = None, device_kv_budget_bytes: int | None = None,
           available_host_bytes: int | None = None, reserved_bytes: int = 0) -> EngineLimits:
    """Derive the runtime limits once the model's context size and KV footprint are known.

    kv_bytes_per_token: K and V bytes of one token over all layers. free_device_bytes: free
    accelerator memory (None on CPU); the default budget takes at most 80% of it, unless
    device_kv_budget_bytes (what the start-up memory profile left for the KV cache) is given:
    then at most that. With neither (CPU), the cache is sized by host_kv_budget from
    available_host_bytes (None: asked of the OS now). reserved_bytes: what the budget (any of these,
    or kv_cache_memory_bytes) holds beside the blocks, taken off it first: a draft model's spare KV
    blocks, its per-token share being in kv_bytes_per_token (lora_runner.executor.draft_budget).
    Raises ValueError when the settings cannot work, kv_cache_memory_bytes is more than
    free_device_bytes, or reserved_bytes leave no block.
    """
    if free_device_bytes is None and device_kv_budget_bytes is None:
        step_sizes(config, max_position_embeddings)  # validates max_model_len
        available = available_host_memory() if available_host_bytes is None else available_host_bytes
        budget = host_kv_budget(
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            context=default_max_model_len(config, max_position_embeddings), block_size=config.block_size,
            kv_bytes_per_token=kv_bytes_per_token, available_bytes=available,
            explicit_bytes=config.kv_cache_memory_bytes, reserved_bytes=reserved_bytes)
        return _limits(config, max_position_embeddings, kv_bytes_per_token, budget.bytes, budget.max_model_len,
                            budget.reason)
    max_model_len, _, _ = step_sizes(config, max_position_embeddings)
    block_bytes = config.block_size * kv_bytes_per_token
    budget = config.kv_cache_memory_bytes
    if budget is None:
        cap = int(free_device_bytes * _CUDA_KV_FRACTION) if free_device_bytes is not None else None
        if device_kv_budget_bytes is not None:
            cap = device_kv_budget_bytes
        check_reserved(reserved_bytes, block_bytes, cap, "gpu_memory_utilization",
                       "the device's KV budget" if device_kv_budget_bytes is None else "the profiled KV budget")
        budget = min(config.max_num_seqs * max_model_len * kv_bytes_per_token, cap - reserved_bytes)
    else:
        if free_device_bytes is not None and budget > free_device_bytes:  # the draft model's weights included
            raise ValueError(f"kv_cache_memory_bytes={budget} is more than the {free_device_bytes} bytes of device "
                             "memory free after the weights: lower kv_cache_memory_bytes")
        check_reserved(reserved_bytes, block_bytes, budget, "kv_cache_memory_bytes")
        budget -= reserved_bytes
    reason = ("kv_cache_memory_bytes" if config.kv_cache_memory_bytes is not None
              else "max_num_seqs full-length requests, at most the device's budget")
    return _limits(config, max_position_embeddings, kv_bytes_per_token, budget, max_model_len, reason)


def _limits(config: EngineConfig, max_position_embeddings: int, kv_bytes_per_token: int, budget: int,
            max_model_len: int, reason: str) -> EngineLimits:
    max_model_len, max_batched, max_blocks_per_seq = step_sizes(config, max_position_embeddings, max_model_len)
    block_bytes = config.block_size * kv_bytes_per_token
    num_blocks = budget // block_bytes
    if num_blocks < max_blocks_per_seq:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds {num_blocks} blocks of {config.block_size} "
            f"tokens, but one request of max_model_len={max_model_len} needs {max_blocks_per_seq} "
            f"({max_blocks_per_seq * block_bytes} bytes): raise kv_cache_memory_bytes or lower max_model_len")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB; %s); max_model_len=%d, %d tokens per step; "
                "%d requests of max_model_len fit at once (more are preempted and recomputed)",
                num_blocks, config.block_size, num_blocks * block_bytes / 2**20, reason, max_model_len,
                max_batched, num_blocks // max_blocks_per_seq)
    return EngineLimits(max_model_len=max_model_len, max_num_batched_tokens=max_batched,
                        num_kv_blocks=num_blocks, max_blocks_per_seq=max_blocks_per_seq)
