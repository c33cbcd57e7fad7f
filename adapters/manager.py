"""The adapter manager: LoRA and prompt-adapter tiers (CPU cache + device slots) of one base model.

It wires each kind's loader (resolve through the Hub or a local dir, read, validate; see
``adapters.lora`` and ``adapters.prompt``) and slot writer (``adapters.slots``) into the generic
LRU tier (``adapters.tier``), which documents the life of an adapter version and thread-safety.
Background loads of both kinds share two small pools of daemon threads (``adapters.load_pools``):
one for adapters already in local directories and one for Hub downloads, so a stalled or slow Hub
never delays an adapter on disk. The threads are daemons and ``close()`` does not wait for them, so
neither close() nor process exit waits for a stalled download.
"""

from __future__ import annotations

import logging
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

from adapters.errors import (
    AdapterCapacityError,
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
)
from adapters.file_limits import default_max_adapter_bytes
from adapters.files import AdapterDir
from adapters.hub import adapter_file_patterns, resolve
from adapters.load_pools import LoadPools
from adapters.lora import dummy_lora, load_lora
from adapters.memory_source import (
    MemoryLoRARequest,
    MemorySnapshots,
    default_memory_adapter_bytes,
    load_memory_lora,
    memory_lora_request,
)
from adapters.prompt import dummy_prompt_adapter, load_prompt_adapter
from adapters.request import LoRARequest, PromptAdapterRequest
from adapters.sharding import shard_spec
from adapters.slot_memory import cpu_cache_bytes, describe_cpu_cache
from adapters.slots import LoRASlots, PromptSlots
from adapters.spec import ModelSpec
from adapters.tier import FAILED, LOADING, READY, AdapterRef, AdapterTier, PromptAdapterTier, TierClosedError
from adapters.vocab_slots import SlotGroup, VocabLoRASlots

__all__ = ["FAILED", "LOADING", "READY", "AdapterManager", "AdapterRef", "AdapterSlots", "AdapterStats",
           "AdapterTier", "PromptAdapterTier", "TierClosedError", "build_slots"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterStats:
    """Cumulative adapter events since the manager was created (a snapshot)."""

    lora_loads: int  # LoRAs written into a device slot
    lora_evictions: int  # resident LoRAs evicted from a slot to make room for another
    lora_disk_loads: int  # LoRAs resolved, read and validated into the CPU cache
    lora_cpu_evictions: int  # LoRAs dropped from the CPU cache (LRU)
    prompt_loads: int
    prompt_evictions: int
    # not an event: the bytes the LoRA CPU cache holds now (a gauge; adapters.cpu_cache)
    lora_cpu_cache_bytes: int = field(default=0, metadata={"gauge": True})
    # the bytes the live snapshots of in-memory LoRAs hold now (a gauge; adapters.memory_source)
    memory_adapter_bytes: int = field(default=0, metadata={"gauge": True})


@dataclass(frozen=True)
class AdapterSlots:
    """The device slots of one model, or of one tensor-parallel rank's share of it (:func:`build_slots`)."""

    lora: LoRASlots  # the LoRA-capable modules' slots
    vocab: VocabLoRASlots | None  # embed_tokens / lm_head LoRA slots; None without a vocabulary or LoRA slots
    prompt: PromptSlots  # soft prompts (whole on every rank)
    lora_set: LoRASlots | SlotGroup  # what the LoRA tier writes: the LoRA slots with the vocabulary ones


def build_slots(spec: ModelSpec, *, max_loras: int, max_lora_rank: int, max_prompt_adapters: int,
                max_prompt_adapter_tokens: int, device, dtype: torch.dtype, rank: int = 0,
                world_size: int = 1) -> AdapterSlots:
    """Allocate the adapter slots of ``spec`` (the whole model's) at ``rank``'s share of it: LoRA and
    vocabulary slots at the shard's sizes (adapters.sharding.shard_spec), soft prompts whole. The one
    construction, for an AdapterManager's own slots and for each worker rank's."""
    local = shard_spec(spec, rank, world_size)
    lora = LoRASlots(local, max_loras, max_lora_rank, device, dtype)
    vocab = (VocabLoRASlots(local, max_loras, max_lora_rank, device, dtype)
             if spec.vocab_size is not None and max_loras > 0 else None)
    prompt = PromptSlots(spec, max_prompt_adapters, max_prompt_adapter_tokens, device, dtype)
    return AdapterSlots(lora, vocab, prompt, lora if vocab is None else SlotGroup(lora, vocab))


class AdapterManager:
    """LoRA and prompt adapters of one base model: CPU caches, device slots, background loading.

    Args:
        spec: the base model's sizes that adapters must agree with.
        max_loras: LoRA device slots (distinct LoRAs per step).
        max_lora_rank: largest LoRA rank accepted; slots are padded to it.
        max_cpu_loras: LoRA CPU cache capacity (>= max_loras).
        max_cpu_lora_bytes: LoRA CPU cache capacity in bytes of weights (adapters.cpu_cache); None:
            ``max_cpu_loras`` adapters of the largest size at ``max_lora_rank``
            (:func:`adapters.slot_memory.cpu_cache_bytes`), so the count binds first.
        max_prompt_adapters: prompt-adapter device slots (0 disables prompt adapters).
        max_prompt_adapter_tokens: largest number of virtual tokens accepted.
        device, dtype: where and in which dtype slots (and the CPU cache) hold weights.
        allow_pickle: also read ``adapter_model.bin`` (with ``torch.load(weights_only=True)``).
        local_files_only: never use the network (None: follow HF_HUB_OFFLINE).
        max_adapter_bytes: refuse adapter files larger than this (checked before reading); None: the
            largest file a valid adapter of ``spec`` at ``max_lora_rank`` can be
            (:func:`adapters.file_limits.default_max_adapter_bytes`).
        resolver: ``(path, revision, allow_patterns, local_files_only) -> local dir``; default
            :func:`adapters.hub.resolve` (with ``cache_dir``). Tests inject faults through it.
        cache_dir: Hub cache directory for the default resolver.
        max_cpu_prompt_adapters: prompt-adapter CPU cache capacity (default: max_cpu_loras, at
            least max_prompt_adapters).
        load_workers: threads for background loads of adapters in local directories.
        download_workers: threads for background loads from the Hub (downloads may stall for long).
        on_load_done: called (from a loader thread, no lock held) whenever a load of either kind
            finishes, fails or is cancelled; an engine uses it to wake a step loop waiting for work.
        base_weight: (layer, packed) -> the base weight [N, K] on ``device``; DoRA adapters are
            refused without it (their norms are computed from it when they load, see adapters.dora).
        make_slots: kind -> the slots the tiers write ("lora": the LoRA slots with the vocabulary ones,
            "prompt"), built elsewhere: an engine whose model lives in worker processes passes proxies
            (``num_slots``, ``write``, ``clear``, ``nbytes``). None: device slots built here, exposed as
            ``lora_slots``, ``vocab_slots``, ``prompt_slots`` (all three None when make_slots is given).
        max_memory_adapter_bytes: bytes the live snapshots of LoRAs handed over in memory may hold together
            (adapters.memory_source); None: :func:`default_memory_adapter_bytes`.
        max_cpu_prompt_adapter_bytes: prompt-adapter CPU cache capacity in bytes of weights (adapters.cpu_cache);
            None: ``max_cpu_prompt_adapters`` soft prompts of ``max_prompt_adapter_tokens`` each
            (:func:`prompt_cache_bytes`), so the count binds first.

    CPU memory: each tier holds at most its CPU cache capacity plus ``load_workers +
    download_workers`` adapter versions (loads in flight), plus one per concurrent ``add`` call;
    further requests wait with their load queued (see adapters.tier). The LoRA cache is bounded by
    ``max_cpu_lora_bytes`` too, the prompt cache by ``max_cpu_prompt_adapter_bytes``: one bound per kind, so
    a flood of one kind never evicts the other.
    """

    def __init__(self, spec: ModelSpec, *, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_prompt_adapters: int = 0, max_prompt_adapter_tokens: int = 0, device="cpu",
                 dtype: torch.dtype = torch.float32, allow_pickle: bool = False, local_files_only: bool | None = None,
                 max_adapter_bytes: int | None = None, resolver: Callable | None = None, cache_dir=None,
                 max_cpu_prompt_adapters: int | None = None, load_workers: int = 2, download_workers: int = 8,
                 on_load_done: Callable[[], None] | None = None, base_weight: Callable | None = None,
                 make_slots: Callable[[str], object] | None = None, max_cpu_lora_bytes: int | None = None,
                 max_memory_adapter_bytes: int | None = None, max_cpu_prompt_adapter_bytes: int | None = None):
        for setting, value in (("max_adapter_bytes", max_adapter_bytes), ("max_cpu_lora_bytes", max_cpu_lora_bytes),
                               ("max_memory_adapter_bytes", max_memory_adapter_bytes),
                               ("max_cpu_prompt_adapter_bytes", max_cpu_prompt_adapter_bytes)):
            if value is not None and value <= 0:
                raise ValueError(f"{setting} must be positive or None, got {value}")
        self.spec, self.device, self.dtype = spec, torch.device(device), dtype
        self.max_lora_rank, self.max_prompt_adapter_tokens = max_lora_rank, max_prompt_adapter_tokens
        self.allow_pickle, self.local_files_only = allow_pickle, local_files_only
        if max_adapter_bytes is None:
            max_adapter_bytes = default_max_adapter_bytes(spec, max_lora_rank, max_prompt_adapter_tokens)
        self.max_adapter_bytes = max_adapter_bytes
        self._resolver = resolver or partial(_default_resolve, cache_dir=cache_dir)
        self._pin_memory = self.device.type == "cuda"
        self._base_weight = base_weight
        if make_slots is None:
            slots = build_slots(spec, max_loras=max_loras, max_lora_rank=max_lora_rank,
                                max_prompt_adapters=max_prompt_adapters,
                                max_prompt_adapter_tokens=max_prompt_adapter_tokens, device=self.device, dtype=dtype)
            # embed_tokens / lm_head LoRA slots (per model) are written and cleared with the LoRA slots
            self.lora_slots, self.vocab_slots, self.prompt_slots = slots.lora, slots.vocab, slots.prompt
            lora_slot_sets, prompt_slot_set = slots.lora_set, slots.prompt
        else:  # the device slots live elsewhere (worker processes): the tiers drive them through these
            self.lora_slots = self.vocab_slots = self.prompt_slots = None
            lora_slot_sets, prompt_slot_set = make_slots("lora"), make_slots("prompt")
        self._executor = LoadPools(load_workers, download_workers)
        in_flight = load_workers + download_workers
        cache_bytes = cpu_cache_bytes(spec, max_cpu_loras, max_lora_rank, dtype, max_cpu_lora_bytes)
        logger.info("%s", describe_cpu_cache(max_cpu_loras, cache_bytes, default=max_cpu_lora_bytes is None))
        if max_memory_adapter_bytes is None:
            max_memory_adapter_bytes = default_memory_adapter_bytes(cache_bytes, max_adapter_bytes)
            how = " (default: max(max_cpu_lora_bytes, 4 x max_adapter_bytes))"
        else:
            how = ""
        logger.info("in-memory LoRA snapshots: max_memory_adapter_bytes=%d%s", max_memory_adapter_bytes, how)
        self.memory_snapshots = MemorySnapshots(max_memory_adapter_bytes)
        self.loras = AdapterTier("LoRA", LoRARequest, self._load_lora, self._dummy_lora, lora_slot_sets,
                                 max_cpu_loras, self._executor, max_loading=in_flight, on_settled=on_load_done,
                                 max_bytes=cache_bytes, snapshots=self.memory_snapshots)
        if max_cpu_prompt_adapters is None:
            max_cpu_prompt_adapters = max(max_cpu_loras, max_prompt_adapters)
        prompt_bytes = max_cpu_prompt_adapter_bytes or prompt_cache_bytes(
            spec, max_cpu_prompt_adapters, max_prompt_adapter_tokens, dtype)
        if max_prompt_adapters:
            logger.info("prompt-adapter CPU cache: max_cpu_prompt_adapters=%d, max_cpu_prompt_adapter_bytes=%d%s",
                        max_cpu_prompt_adapters, prompt_bytes, "" if max_cpu_prompt_adapter_bytes else
                        " (default: that many soft prompts of max_prompt_adapter_tokens)")
        self.prompts = PromptAdapterTier("prompt adapter", PromptAdapterRequest, self._load_prompt,
                                         self._dummy_prompt, prompt_slot_set, max_cpu_prompt_adapters,
                                         self._executor, max_loading=in_flight, on_settled=on_load_done,
                                         max_bytes=prompt_bytes, bytes_setting="max_cpu_prompt_adapter_bytes")

    @property
    def stats(self) -> AdapterStats:
        """Cumulative loads and evictions of both tiers."""
        lora, prompt = self.loras.counts(), self.prompts.counts()
        return AdapterStats(lora_loads=lora["slot_loads"], lora_evictions=lora["slot_evictions"],
                            lora_disk_loads=lora["disk_loads"], lora_cpu_evictions=lora["cpu_evictions"],
                            prompt_loads=prompt["slot_loads"], prompt_evictions=prompt["slot_evictions"],
                            lora_cpu_cache_bytes=self.loras.cpu_bytes,
                            memory_adapter_bytes=self.memory_snapshots.nbytes)

    @contextmanager
    def memory_update(self, name: str, state_dict, config, owner: str | None = None, share: float | None = None):
        """The request of an update of LoRA ``name`` from tensors in memory (adapters.memory_source), its
        snapshot counted against ``max_memory_adapter_bytes`` and charged to ``owner`` (MemoryAdapterBoundError,
        before any copy, when it would pass the bound; MemoryAdapterShareError when it would pass the owner's
        ``share`` of it, if given): serve it inside the block; after it the snapshot is released unless it
        is in use (served, or a live version of it)."""
        request = memory_lora_request(name, state_dict, config, max_bytes=self.max_adapter_bytes,
                                      snapshots=self.memory_snapshots, owner=owner, share=share)
        try:
            yield request
        finally:
            self.memory_snapshots.settle(request.path)
            self.loras.release_snapshots()

    def close(self) -> None:
        """Stop background loading and return at once: queued and running loads fail ("cancelled"),
        new acquire/add/prefetch calls raise TierClosedError; a worker stuck in a download is a
        daemon thread that discards its result and never delays process exit. Idempotent."""
        self.loras.close()
        self.prompts.close()
        self._executor.shutdown()

    def _resolve(self, request) -> str:
        try:
            return self._resolver(request.path, request.revision, adapter_file_patterns(self.allow_pickle),
                                  self.local_files_only)
        except AdapterError as exc:  # resolve() names the path; name the adapter too
            raise type(exc)(f"adapter {request.name!r}: {exc}") from exc
        except Exception as exc:  # a custom resolver's failure is a not-found, not an engine crash
            raise AdapterNotFoundError(f"adapter {request.name!r}: resolving {request.path!r} failed: "
                                       f"{exc!r}") from exc

    def _open_dir(self, request) -> AdapterDir:
        """The adapter's directory, held open while it is read: a request with a root is walked beneath
        it without following links (never the Hub nor the resolver); any other is resolved (local or Hub)."""
        if request.root is None:
            opener = partial(AdapterDir.local, self._resolve(request))  # _resolve names the adapter itself
        else:
            opener = partial(AdapterDir.confined, request.root, request.relative_path)
        try:
            return opener()
        except AdapterError as exc:
            raise type(exc)(f"adapter {request.name!r}: {exc}") from exc

    def _load_lora(self, request: LoRARequest):
        if isinstance(request, MemoryLoRARequest):  # handed over in memory: the same validation, no file
            weights = load_memory_lora(request, self.spec, max_lora_rank=self.max_lora_rank, dtype=self.dtype,
                                       base_weight=self._base_weight)
            return weights.pin_memory() if self._pin_memory else weights
        with self._open_dir(request) as directory:
            weights = load_lora(request.name, directory, self.spec, max_lora_rank=self.max_lora_rank,
                                dtype=self.dtype, allow_pickle=self.allow_pickle, max_bytes=self.max_adapter_bytes,
                                base_weight=self._base_weight)
        return weights.pin_memory() if self._pin_memory else weights

    def _load_prompt(self, request: PromptAdapterRequest):
        self._check_prompts_enabled(request.name)
        with self._open_dir(request) as directory:
            weights = load_prompt_adapter(request.name, directory, self.spec,
                                          max_prompt_adapter_tokens=self.max_prompt_adapter_tokens, dtype=self.dtype,
                                          allow_pickle=self.allow_pickle, max_bytes=self.max_adapter_bytes)
        return weights.pin_memory() if self._pin_memory else weights

    def _dummy_lora(self, name: str, rank: int):
        if rank > self.max_lora_rank:
            raise AdapterTooLargeError(f"dummy LoRA {name!r}: rank {rank} > max_lora_rank={self.max_lora_rank}")
        # seeded by name: distinct dummies differ, so a benchmark that mixes them can see a wrong slot
        return dummy_lora(name, self.spec, rank, self.dtype, seed=zlib.crc32(name.encode()))

    def _dummy_prompt(self, name: str, num_virtual_tokens: int):
        self._check_prompts_enabled(name)
        if num_virtual_tokens > self.max_prompt_adapter_tokens:
            raise AdapterTooLargeError(f"dummy prompt adapter {name!r}: {num_virtual_tokens} virtual tokens > "
                                       f"max_prompt_adapter_tokens={self.max_prompt_adapter_tokens}")
        return dummy_prompt_adapter(name, self.spec, num_virtual_tokens, self.dtype)

    def _check_prompts_enabled(self, name: str) -> None:
        if self.prompts.slots.num_slots == 0:
            raise AdapterCapacityError(f"prompt adapter {name!r}: prompt adapters are disabled "
                                       "(max_prompt_adapters=0)")


def prompt_cache_bytes(spec: ModelSpec, max_cpu_prompt_adapters: int, max_prompt_adapter_tokens: int,
                       dtype: torch.dtype) -> int:
    """The prompt-adapter CPU cache's default byte bound: ``max_cpu_prompt_adapters`` soft prompts of the
    largest size one can be ([max_prompt_adapter_tokens, hidden] in ``dtype``), so that, as for LoRAs
    (adapters.slot_memory.cpu_cache_bytes), the count binds first and no setup that runs by count is
    refused by bytes. At least one byte (prompt adapters off: no soft prompt is ever cached)."""
    item = torch.empty((), dtype=dtype).element_size()
    return max(max_cpu_prompt_adapters * max_prompt_adapter_tokens * spec.hidden_size * item, 1)


def _default_resolve(path, revision, allow_patterns, local_files_only, cache_dir=None) -> str:
    return resolve(path, revision, allow_patterns=allow_patterns, local_files_only=local_files_only,
                   cache_dir=cache_dir)
