"""A draft model's share of the memory budget (speculative decoding's "draft_model" method).

The draft runs in the engine's process (lora_runner.worker.draft_runner) over its own paged KV cache: a
block for each of the target's KV blocks, of its own size (its layers and KV heads), plus spare blocks for
the k proposals of each of max_num_seqs sequences (draft_kv_blocks). Whatever budget sizes the target's
cache holds the draft's too, as in vLLM, where the draft's attention layers join the target's in one KV
cache spec, so that the profiled memory and kv_cache_memory_bytes are divided over both: each token of
the target's cache costs the target's bytes plus the draft's, and the spare blocks come off the budget
first (engine_limits' reserved_bytes). That holds on every path:

- CUDA, one process: the memory profile's budget (the draft's weights are loaded before the profile, so
  they count as resident), or kv_cache_memory_bytes (which must then be free after both models' weights);
- worker ranks (tensor_parallel_size > 1): kv_cache_memory_bytes per rank on CUDA, where the draft's cache
  sits beside rank 0's on the engine's device and every rank keeps the one block count; on CPU the host's
  bound over every rank's blocks;
- CPU: the RAM-based bound or kv_cache_memory_bytes, with the draft's weights taken off the RAM available
  before the bound is drawn (as the LoRA slots of worker ranks are).

The draft adapters' device slots (``max_draft_loras`` at max_lora_rank, lora_runner.spec_decode.draft_adapters)
are allocated with the speculator, after every budget is drawn, so their bytes (adapters.slot_memory, the slot
classes' own tensors) are taken off what is available first: the profiled budget on CUDA (the profile did not
see them resident), the device memory free for kv_cache_memory_bytes, the RAM on CPU; the target's slots are
resident before the profile, or taken off the same way.

The draft adapters' CPU cache (their AdapterManager's, with its default byte bound: max(max_cpu_loras,
max_draft_loras) draft adapters of the largest size at max_lora_rank, adapters.slot_memory.cpu_cache_bytes)
follows the rule of the model's LoRA CPU cache (lora_runner.executor.startup): on CPU its bound is taken off the
RAM before the KV budget is drawn for worker ranks always, and in the engine's own process only when
max_cpu_lora_bytes is set explicitly (the operator then reserves RAM for adapter caches; by default neither
bound is, so existing CPU setups keep their KV cache).

A budget too small for the draft's spare blocks plus one block, or for its adapter slots, is a ValueError naming
the setting to change.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import torch

from adapters.slot_memory import cpu_cache_bytes, lora_slot_bytes
from lora_runner.config import EngineConfig
from lora_runner.executor.limits import EngineLimits, engine_limits
from lora_runner.spec_decode.draft_adapters import DraftLoRASettings
from lora_runner.worker.draft_runner import LoadedDraft, draft_kv_blocks
from lora_runner.worker.kv_cache import kv_block_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftMemory:
    """What a loaded draft model takes beside the target, in bytes."""

    weight_bytes: int  # its parameters and buffers
    block_bytes: int  # one block of its KV cache (block_size tokens, all its layers, K and V)
    spare_blocks: int  # its KV blocks beyond one per target block (draft_kv_blocks)
    block_size: int
    lora_slot_bytes: int = 0  # its draft adapters' device slots, allocated after the budget is drawn
    num_lora_slots: int = 0  # max_draft_loras
    cpu_cache_bytes: int = 0  # its draft adapters' CPU cache bound (on CPU taken off the RAM as the model's is)

    @property
    def per_token_bytes(self) -> int:
        """The draft's KV bytes for each token of the target's cache."""
        return self.block_bytes // self.block_size

    @property
    def spare_bytes(self) -> int:
        """The spare blocks' bytes: taken off the KV budget before the target's blocks are counted."""
        return self.spare_blocks * self.block_bytes

    def kv_blocks(self, num_kv_blocks: int) -> int:
        """The draft's KV blocks beside a target cache of num_kv_blocks."""
        return num_kv_blocks + self.spare_blocks


def draft_lora_settings(cfg: EngineConfig) -> DraftLoRASettings:
    """The draft adapters' limits in an engine of `cfg` (a "draft_model" speculative_config): max_draft_loras
    slots (default max_loras) and the engine's adapter limits."""
    return DraftLoRASettings(cfg.speculative().max_draft_loras or cfg.max_loras, cfg.max_lora_rank, cfg.cpu_loras,
                             cfg.allow_pickle, cfg.local_files_only, cfg.max_adapter_bytes)


def draft_memory(draft: LoadedDraft, cfg: EngineConfig) -> DraftMemory:
    """The DraftMemory of `draft` in an engine of `cfg` (its speculative k, block_size, max_num_seqs, dtype and
    draft adapter slots)."""
    k, dtype = cfg.speculative().num_speculative_tokens, cfg.torch_dtype()
    settings, spec = draft_lora_settings(cfg), draft.config.spec()
    slots = settings.max_draft_loras
    return DraftMemory(weight_bytes=model_bytes(draft.model),
                       block_bytes=kv_block_bytes(draft.config, cfg.block_size, dtype),
                       spare_blocks=draft_kv_blocks(0, max_num_seqs=cfg.max_num_seqs, k=k, block_size=cfg.block_size),
                       block_size=cfg.block_size, num_lora_slots=slots,
                       lora_slot_bytes=slots * lora_slot_bytes(spec, cfg.max_lora_rank, dtype).per_slot,
                       # the bound the draft's AdapterManager draws itself (DraftAdapters: no explicit bound given)
                       cpu_cache_bytes=cpu_cache_bytes(spec, settings.cpu_cache_loras, cfg.max_lora_rank, dtype))


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor `model` holds: parameters, buffers and plain tensor attributes (on CPU the
    packed GEMM weights, lora_runner.model.cpu_gemm, replace the parameters they were packed from)."""
    tensors = {}
    for module in model.modules():
        for value in chain(module._parameters.values(), module._buffers.values(), vars(module).values()):
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value  # a tied weight once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def limits_with_draft(cfg: EngineConfig, max_position_embeddings: int, kv_bytes_per_token: int,
                      draft: DraftMemory | None, free_device_bytes: int | None = None,
                      device_kv_budget_bytes: int | None = None,
                      available_host_bytes: int | None = None, *, with_cpu_cache: bool = False) -> EngineLimits:
    """engine_limits (same arguments) with the draft's share of the budget counted (see the module
    docstring) and logged; without a draft (None), engine_limits itself. available_host_bytes: the RAM
    available before the draft's weights were loaded (they are taken off it here, and with ``with_cpu_cache``
    its adapters' CPU cache bound too: worker ranks, or max_cpu_lora_bytes set; startup decides)."""
    if draft is None:
        return engine_limits(cfg, max_position_embeddings, kv_bytes_per_token, free_device_bytes,
                             device_kv_budget_bytes, available_host_bytes)
    slots = draft.lora_slot_bytes
    cache_off = with_cpu_cache and available_host_bytes is not None
    if available_host_bytes is not None:
        cache = draft.cpu_cache_bytes if cache_off else 0
        available_host_bytes = max(available_host_bytes - draft.weight_bytes - slots - cache, 0)
    if free_device_bytes is not None:
        free_device_bytes = _less_slots(free_device_bytes, draft, "the device memory free after the weights")
    if device_kv_budget_bytes is not None:
        device_kv_budget_bytes = _less_slots(device_kv_budget_bytes, draft, "the profiled KV budget",
                                             ", or raise gpu_memory_utilization")
    limits = engine_limits(cfg, max_position_embeddings, kv_bytes_per_token + draft.per_token_bytes,
                           free_device_bytes, device_kv_budget_bytes, available_host_bytes,
                           reserved_bytes=draft.spare_bytes)
    blocks = draft.kv_blocks(limits.num_kv_blocks)
    logger.info("draft model: weights %d bytes (%.1f MiB); its %d adapter slots %d bytes (%.1f MiB), taken off "
                "before the KV budget; its adapters' CPU cache bound %d bytes (%.1f MiB), %s; its KV cache %d "
                "blocks, %d bytes (%.1f MiB), in the KV budget beside the model's %d blocks", draft.weight_bytes,
                draft.weight_bytes / 2**20, draft.num_lora_slots, slots, slots / 2**20, draft.cpu_cache_bytes,
                draft.cpu_cache_bytes / 2**20, _where_cache(cache_off, available_host_bytes is not None), blocks,
                blocks * draft.block_bytes, blocks * draft.block_bytes / 2**20, limits.num_kv_blocks)
    return limits


def _where_cache(taken_off: bool, on_cpu: bool) -> str:
    """Whether the draft adapters' CPU cache bound came off the RAM the KV budget is drawn from, for the log."""
    if taken_off:
        return "taken off the RAM before the KV budget"
    if on_cpu:
        return "not taken off the RAM (max_cpu_lora_bytes unset: as the model's cache)"
    return "in host RAM, outside the device KV budget"


def _less_slots(available: int, draft: DraftMemory, what: str, more: str = "") -> int:
    """`available` device bytes less the draft's adapter slots; a ValueError naming the settings (and `more`)
    when they do not fit."""
    if draft.lora_slot_bytes >= available:
        raise ValueError(f"the draft model's {draft.num_lora_slots} adapter slots take {draft.lora_slot_bytes} "
                         f"bytes, not less than {what} ({available} bytes): lower max_draft_loras (speculative_config) "
                         f"or max_lora_rank{more}")
    return available - draft.lora_slot_bytes
