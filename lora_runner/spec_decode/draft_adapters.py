"""Per-request draft adapters of the "draft_model" method: ``LoRARequest(..., draft_lora_path=PATH)`` names a
PEFT LoRA trained for the draft model, so a tenant's draft proposes what its adapted target would decode.

The draft model owns its LoRA layers as the target does, so its adapters take the target's path: one
adapters.AdapterManager over the draft model's ModelSpec (LoRA only, no soft prompts) resolves, reads and
validates them with the same loaders, limits (max_lora_rank, max_adapter_bytes, safetensors unless
allow_pickle) and AdapterError subclasses, in the background, into a CPU cache (max_cpu_loras; its default
byte bound comes off the CPU RAM where the model's does: lora_runner.executor.draft_budget) and a few
device slots (``max_draft_loras``, default max_loras) written and evicted LRU by its tier.

A request's draft adapter (held from the request's first schedule() until it finishes):

- loads beside its target adapter: the scheduler admits the request only once it is ready
  (``state``), exactly as it waits for the target adapter, so no step waits on a load;
- one that fails refuses the request: ``state`` says "failed" with the AdapterError in ``request.error``
  and the scheduler fails it alone ("error"), before it runs;
- each step, ``slots`` makes the draft adapters of the requests that run in the draft forward resident,
  at most max_draft_loras distinct ones; with more, they take turns (the one that had a slot longest ago
  first): a request whose draft adapter gets no slot this step skips the draft forward (no proposals;
  its draft KV is computed with its adapter only) and catches up in a later step. Requests without a draft
  adapter run the draft without LoRA in the same batched forward (slot -1).

The draft's KV of a request depends on its draft adapter; the draft's block pool has no prefix caching,
so no KV is ever shared between requests (whatever their adapters). Verification is unchanged: outputs
are exactly those without speculation, only acceptance changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adapters.errors import AdapterError
from adapters.manager import AdapterManager
from adapters.request import LoRARequest
from adapters.spec import ModelSpec
from adapters.tier import AdapterRef, TierClosedError
from lora_runner.core.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftLoRASettings:
    """The engine's adapter limits the draft adapters follow (EngineConfig's fields of the same names)."""

    max_draft_loras: int  # device slots of the draft model's LoRA (distinct draft adapters per draft forward)
    max_lora_rank: int
    max_cpu_loras: int
    allow_pickle: bool = False
    local_files_only: bool | None = None
    max_adapter_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.max_draft_loras < 1:
            raise ValueError(f"max_draft_loras must be >= 1, got {self.max_draft_loras}")

    @property
    def cpu_cache_loras(self) -> int:
        """How many draft adapters the CPU cache keeps: max_cpu_loras, and at least one per device slot."""
        return max(self.max_cpu_loras, self.max_draft_loras)


class DraftAdapters:
    """The draft model's adapters, per request (see the module docstring).

    Args:
        spec: the draft model's ModelSpec (ModelConfig.spec()).
        settings: slots, rank and file limits.
        device, dtype: of the slots (the draft model's).
        base_weight: the draft model's base weights for DoRA (lora_runner.model.layers.lora_base_weights).
    """

    def __init__(self, spec: ModelSpec, settings: DraftLoRASettings, *, device: torch.device, dtype: torch.dtype,
                 base_weight=None) -> None:
        self.manager = AdapterManager(spec, max_loras=settings.max_draft_loras, max_lora_rank=settings.max_lora_rank,
                                      max_cpu_loras=settings.cpu_cache_loras,
                                      device=device, dtype=dtype, allow_pickle=settings.allow_pickle,
                                      local_files_only=settings.local_files_only,
                                      max_adapter_bytes=settings.max_adapter_bytes, base_weight=base_weight)
        self.tier = self.manager.loras
        self.num_slots = settings.max_draft_loras
        self._refs: dict[Request, AdapterRef] = {}  # requests holding a draft adapter version
        self._unready: set[Request] = set()  # requests whose draft adapter failed after they were admitted
        self._step = 0  # slots() calls
        self._last_slot: dict[AdapterRef, int] = {}  # held version -> the last slots() call that gave it a slot

    @property
    def lora_slots(self):
        """The draft model's LoRASlots (read by its forward)."""
        return self.manager.lora_slots

    @property
    def vocab_slots(self):
        """The draft model's embed_tokens / lm_head LoRA slots (None without a vocabulary)."""
        return self.manager.vocab_slots

    def state(self, request: Request) -> str:
        """The request's draft adapter: "ready" (or none named), "loading" or "failed" (its AdapterError in
        request.error). The first call acquires it: its background load starts."""
        lora = request.lora_request
        draft = None if lora is None else getattr(lora, "draft_lora_path", None)
        if draft is None:
            return "ready"
        ref = self._refs.get(request)
        if ref is None:
            try:
                ref = self._refs[request] = self.tier.acquire(lora.draft_request)
            except TierClosedError as error:  # the engine closed: the request cannot start any more
                request.error = error
                return "failed"
        state = self.tier.state(ref)
        if state == "failed" and request.error is None:
            request.error = _named(lora, self.tier.error(ref))
        return state

    def add(self, lora: LoRARequest, fresh: bool = False, publish_lock=None) -> None:
        """Load and validate the draft adapter `lora` names now, in the calling thread (LLMEngine.add_lora,
        so LLM.generate refuses a bad one before any work); its AdapterError otherwise. ``fresh``
        (load_inplace): read again from what its path holds now, and serve the draft adapter's name from
        the next request on, published under ``publish_lock`` (the engine's step lock: publishing retires
        the old version, which may free a slot)."""
        try:
            if not fresh:
                self.tier.add(lora.draft_request)
                return
            ref = self.tier.stage(lora.draft_request, fresh=True)
        except AdapterError as error:
            raise _named(lora, error) from error
        try:
            with publish_lock if publish_lock is not None else contextlib.nullcontext():
                self.tier.publish(None, True, ref)
        finally:
            self.tier.release(ref)

    def slots(self, requests: Sequence[Request]) -> dict[Request, int]:
        """Make this step's draft adapters resident: request -> its draft LoRA slot (-1: none named) for the
        requests that may run in the draft forward; those whose adapter got no slot (more distinct ones
        than slots; or it failed) are left out. With more distinct ones than slots they take turns: the
        adapters that had a slot longest ago go first (then in the order given), so none starves."""
        self._step += 1
        wanted = list(dict.fromkeys(ref for request in requests if (ref := self._refs.get(request)) is not None
                                    and self.tier.state(ref) == "ready"))
        chosen = sorted(wanted, key=lambda ref: self._last_slot.get(ref, 0))[:self.num_slots]  # stable
        for ref in chosen:
            self._last_slot[ref] = self._step
        slot_of = dict(zip(chosen, self.tier.activate(chosen))) if chosen else {}
        out = {}
        for request in requests:
            ref = self._refs.get(request)
            if ref is None:
                out[request] = -1
            elif slot_of.get(ref) is not None:
                out[request] = slot_of[ref]
            elif self.tier.state(ref) == "failed" and request not in self._unready:
                self._unready.add(request)  # a slot write failed: its tokens stay exact, it proposes no more
                logger.warning("request %r: its draft adapter failed (%s); it goes on without proposals",
                               request.request_id, self.tier.error(ref))
        return out

    def release(self, request: Request) -> None:
        """The request finished: its draft adapter version is let go (evictable, or dropped if retired)."""
        self._unready.discard(request)
        ref = self._refs.pop(request, None)
        if ref is not None:
            self.tier.release(ref)
            if ref not in self._refs.values():
                self._last_slot.pop(ref, None)

    def close(self) -> None:
        """Stop background loads at once (AdapterManager.close): waiting requests whose draft adapter was
        not loaded fail; running ones go on with the adapters they have."""
        self.manager.close()


def _named(lora: LoRARequest, error: AdapterError) -> AdapterError:
    """`error` (its own class) with a message that says it is the draft model's adapter of `lora` (its path
    relative to the request's root, as the adapter's own errors name it: a server shows it to tenants)."""
    return type(error)(f"the draft model's adapter {lora.draft_request.relative_path!r} of LoRA {lora.name!r} "
                       f"(speculative_config draft_model): {error}")
