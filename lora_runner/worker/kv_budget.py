"""How large the KV cache is on CPU: what the workload can use, bounded by the host's available RAM.

On CPU the cache is host memory that the OS commits page by page as blocks are first written
(lora_runner.worker.kv_cache allocates it without touching it, and the block manager reuses the most
recently freed blocks first), so its size is the most RAM it may ever take, not what start-up
costs. The default budget is the smallest of

- what the workload can use: max_num_seqs requests of max_model_len tokens;
- CPU_KV_MEMORY_FRACTION (a quarter) of the RAM available when the engine starts (psutil);
- CPU_KV_CAP_BYTES (4 GiB).

When fewer than max_num_seqs full-length requests fit, requests are admitted while blocks last and
the newest running one is preempted (recomputed later) when the cache runs out. When not even one
request of the default max_model_len (the model's context) fits, max_model_len is lowered to what
does. An explicit max_model_len that needs more than the bound for one request gets exactly one
request's worth and a warning (ValueError beyond the available RAM); an explicit
kv_cache_memory_bytes is used as given, with a warning when it exceeds the bound (and the default
max_model_len is lowered to fit it too).

With a draft model (speculative decoding) the bound or kv_cache_memory_bytes holds the draft's KV
cache too: each token costs the target's bytes and the draft's (kv_bytes_per_token), and the draft's
spare blocks (reserved_bytes) come off first.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.25  # of the RAM available at start-up
CPU_KV_CAP_BYTES = 4 << 30


@dataclass(frozen=True)
class HostKVBudget:
    """The CPU KV cache's size in bytes, the max_model_len it serves, and why (for the log)."""

    bytes: int
    max_model_len: int
    reason: str


def host_kv_budget(*, max_num_seqs: int, max_model_len: int | None, context: int, block_size: int,
                   kv_bytes_per_token: int, available_bytes: int, explicit_bytes: int | None,
                   reserved_bytes: int = 0) -> HostKVBudget:
    """The CPU KV budget (see the module docstring).

    max_model_len: the user's setting (None: `context`, the model's, may be lowered to fit);
    kv_bytes_per_token: K and V of one token over all layers; available_bytes: RAM available now;
    explicit_bytes: the user's kv_cache_memory_bytes (None: the default budget); reserved_bytes: what
    that budget holds beside the blocks (a draft model's spare KV blocks, lora_runner.executor.
    draft_budget), taken off the bound or explicit_bytes before the blocks are counted: the bytes
    returned are the blocks'. ValueError when it leaves less than one block.
    """
    block_bytes = block_size * kv_bytes_per_token
    bound = min(CPU_KV_CAP_BYTES, int(available_bytes * CPU_KV_MEMORY_FRACTION))
    bound_text = (f"{CPU_KV_MEMORY_FRACTION:.0%} of {_gib(available_bytes)} available RAM, at most "
                  f"{_gib(CPU_KV_CAP_BYTES)}: {_gib(bound)}")
    check_reserved(reserved_bytes, block_bytes, bound if explicit_bytes is None else explicit_bytes,
                   "kv_cache_memory_bytes", f"the CPU bound ({bound_text})" if explicit_bytes is None else None)
    length = max_model_len or context
    seq_bytes = -(-length // block_size) * block_bytes
    if explicit_bytes is not None:
        if explicit_bytes > bound:
            logger.warning("kv_cache_memory_bytes=%d (%s) exceeds the default CPU bound (%s): the cache may "
                           "grow to it as requests fill it", explicit_bytes, _gib(explicit_bytes), bound_text)
        blocks_bytes = explicit_bytes - reserved_bytes
        if max_model_len is None and block_bytes <= blocks_bytes < seq_bytes:
            fitted = blocks_bytes // block_bytes * block_size
            return HostKVBudget(blocks_bytes, fitted, f"kv_cache_memory_bytes; max_model_len lowered from the "
                                                      f"model's context {context} to {fitted} tokens to fit")
        return HostKVBudget(blocks_bytes, length, "kv_cache_memory_bytes")
    bound -= reserved_bytes  # the bound holds the draft's spare blocks too: the rest is the blocks'
    wanted = max_num_seqs * seq_bytes
    if wanted <= bound:
        return HostKVBudget(wanted, length, f"max_num_seqs={max_num_seqs} requests of max_model_len={length} "
                                            f"tokens, under the CPU bound ({bound_text})")
    if seq_bytes <= bound:
        return HostKVBudget(bound, length, f"the CPU bound ({bound_text}), less than max_num_seqs="
                                           f"{max_num_seqs} x max_model_len={length} tokens ({_gib(wanted)})")
    if max_model_len is None:
        fitted = min(max(bound // block_bytes, 1) * block_size, context)
        return HostKVBudget(max(bound, block_bytes), fitted,
                            f"the CPU bound ({bound_text}); max_model_len lowered from the model's context "
                            f"{context} to {fitted} tokens to fit one request: set max_model_len and "
                            "kv_cache_memory_bytes to choose")
    if seq_bytes > available_bytes:
        raise ValueError(f"max_model_len={length} needs {_gib(seq_bytes)} of KV cache for one request, more than "
                         f"the {_gib(available_bytes)} of RAM available: lower max_model_len")
    logger.warning("max_model_len=%d needs %s of KV cache for one request, more than the default CPU bound "
                   "(%s): sizing the cache for that one request; lower max_model_len to use less",
                   length, _gib(seq_bytes), bound_text)
    return HostKVBudget(seq_bytes, length, f"one request of max_model_len={length}, over the CPU bound")


def check_reserved(reserved_bytes: int, block_bytes: int, budget_bytes: int, setting: str,
                   budget_text: str | None = None) -> None:
    """ValueError naming `setting` when `reserved_bytes` (a draft model's spare KV blocks) leave less than one
    block of `block_bytes` in `budget_bytes` (described as `budget_text`; None: the setting's value)."""
    if reserved_bytes and budget_bytes - reserved_bytes < block_bytes:
        raise ValueError(f"the draft model's KV cache needs {reserved_bytes} bytes for its spare blocks (max_num_seqs "
                         f"x num_speculative_tokens tokens), leaving less than one {block_bytes}-byte KV block of the "
                         f"{budget_bytes} bytes of {budget_text or setting}: raise {setting} or lower max_num_seqs or "
                         "num_speculative_tokens")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
