"""The engine's one seam to its adapters: LoRAs and prompt adapters through the same calls.

A request holds an AdapterRef per adapter kind it names (``request.lora_ref``,
``request.prompt_adapter_ref``) from add_request until it is reported finished:

    acquire(request)            both kinds, or neither (a failure releases what was acquired)
    failure(request)            the load error of one of its adapters, if any failed
    activate(scheduled)         make the step's adapters resident: (LoRA ref -> slot, prompt ref -> slot)
    place(scheduled)            activate, as Scheduler.schedule asks for it: a Placement (slots, unplaced)
    release(request)            exactly once, when the request is reported finished

Served names (what the server offers: one namespace for both kinds) live in the tiers' version tables
too: ``serve`` loads, validates and publishes an adapter under its name, ``withdraw`` stops serving
it, ``served`` / ``served_all`` read them (``adapters.versions.ServedAdapter``).

Pins, reservations and load state live in the adapter tiers only (``adapters.tier``): the scheduler
asks each tier's ``state`` and ``reserved_slots`` directly. ``step_lock`` is held by the engine from
scheduling to activation; pins and removals take it, so a pin from another thread can never take a
slot the step counted on.

Prompt adapters (PEFT prompt-tuning soft prompts) add one thing: once the adapter is loaded, so that
its number of virtual tokens n is known, n placeholder tokens are put in front of the request's
prompt. They take positions 0..n-1 and the prompt n.., exactly as PEFT prepends its soft prompt,
and the KV cache and attention treat them as ordinary prompt tokens (max_model_len counts them). The
batch builder maps each placeholder to the adapter's device slot and virtual index, and the model's
embedding step overwrites the placeholder embeddings with the soft prompt. A soft prompt needs its
slot only while its placeholders are being computed: at the first prefill, and again when a
preempted request recomputes its tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from contextlib import contextmanager

from adapters.manager import AdapterManager
from adapters.request import LoRARequest
from adapters.tier import AdapterRef, AdapterTier, TierClosedError
from adapters.versions import ServedAdapter
from lora_runner.core.request import Request
from lora_runner.core.scheduler_output import Placement, ScheduledRequest
from lora_runner.engine.errors import EngineClosedError
from lora_runner.engine.input_processor import check_prompt_adapter_request

logger = logging.getLogger(__name__)


class EngineAdapters:
    """Adapters of one LLMEngine, both kinds behind one interface.

    Args:
        manager: the adapter manager (its ``loras`` and ``prompts`` tiers, CPU caches, slots, loading);
            ``engine.adapters.manager`` is the one way to reach it from an LLMEngine.
        max_model_len: the engine's limit on placeholders + prompt + generated tokens.
        prompts_enabled: False when the engine has no prompt-adapter slots (max_prompt_adapters=0).
    """

    def __init__(self, manager: AdapterManager, max_model_len: int, prompts_enabled: bool) -> None:
        self.manager, self.max_model_len, self.prompts_enabled = manager, max_model_len, prompts_enabled
        self.tiers: dict[str, AdapterTier] = {"lora": manager.loras, "prompt": manager.prompts}
        self.step_lock = threading.Lock()
        # the speculative draft model's per-request adapters (spec_decode.draft_adapters), set by the engine
        self.draft_adapters = None

    # ------------------------------------------------------------------ user side, per kind
    # kind: "lora" or "prompt"; AdapterAPI's add_lora, pin_prompt_adapter, ... (lora_runner.engine.adapter_api)
    # call these for LLMEngine, LLM and AsyncLLMEngine.
    def add(self, kind: str, request, load_inplace: bool = False) -> AdapterRef:
        """Load and validate now (hot-load). A new path under a known name replaces it once it
        loaded (running requests keep the old weights); if it fails, the old version keeps serving.
        ``load_inplace``: a new version is read from what the source holds now even when the name
        already serves this very source (its files were rewritten), and serves the name from the
        next step on. Raises the adapter's AdapterError (ValueError for a disabled or mistyped prompt
        adapter); a LoRA's draft adapter (LoRARequest.draft_lora_path, with a draft model) loads too."""
        if kind == "prompt":
            check_prompt_adapter_request(request, self.prompts_enabled)
        tier = self.tiers[kind]
        if not load_inplace:
            with _closed_as_engine_error():
                ref = tier.add(request)
            self._add_draft(kind, request)
            return ref
        with _closed_as_engine_error():
            ref = tier.stage(request, fresh=True)
        try:
            self._add_draft(kind, request, fresh=True)
            with self.step_lock:  # publishing retires the replaced version, which may free its slot
                tier.publish(None, True, ref)
        finally:
            tier.release(ref)
        return ref

    def _add_draft(self, kind: str, request, fresh: bool = False) -> None:
        """Load and validate a LoRA's draft adapter now (LoRARequest.draft_lora_path, with a draft model): its
        AdapterError raised here; ``fresh`` (load_inplace): read again. Nothing without one."""
        if kind != "lora" or not getattr(request, "draft_lora_path", None):
            return
        if self.draft_adapters is None:
            logger.warning("LoRA %r names a draft adapter, unused: the engine has no draft model "
                           '(speculative_config method "draft_model")', request.name)
        else:
            with _closed_as_engine_error():
                self.draft_adapters.add(request, fresh=fresh, publish_lock=self.step_lock)

    def update(self, name: str, state_dict, config, owner: str | None = None,
               claim: Callable[[], bool] | None = None, tenant_share: float | None = None) -> ServedAdapter | None:
        """Serve a new version of the LoRA ``name`` from tensors in memory (a PEFT state dict and its
        LoraConfig or adapter_config dict, adapters.memory_source), validated as a file load is. The
        version serves the name from the next step on; running requests finish on theirs. ``owner``:
        the tenant updating it (None keeps the served record's owner). Returns the served adapter with
        ``version`` the new version and ``request`` what later requests for it pass (None when ``claim``,
        asked as in ``serve``, said no). Raises its AdapterError (the current version keeps serving;
        MemoryAdapterBoundError when the live snapshots would pass max_memory_adapter_bytes;
        MemoryAdapterShareError when the owner's would pass ``tenant_share`` of it, if given: the server's
        share for a tenant), ValueError when a prompt adapter has the name. The snapshot is charged to the
        adapter's owner (adapters.memory_source)."""
        if owner is None:
            old = self.tiers["lora"].served(name)
            owner = None if old is None else old.owner
        # counted against max_memory_adapter_bytes and the owner's share of it
        with self.manager.memory_update(name, state_dict, config, owner=owner, share=tenant_share) as request:
            return self.serve(request, owner=owner, replace=True, claim=claim)

    def remove(self, kind: str, name: str) -> None:
        """Forget ``name`` and its pin; deferred while running requests use it (they finish on its weights)."""
        with self.step_lock:
            self.tiers[kind].remove(name)

    def pin(self, kind: str, name: str) -> None:
        """Pin the version ``name`` serves: kept cached and, once resident, in its device slot. At most (slots - 1)
        adapters of a kind can be pinned (AdapterCapacityError beyond), so unpinned ones always keep a slot;
        a replacement inherits the pin once it takes over; a failed load holds none."""
        with self.step_lock:
            self.tiers[kind].pin(name)

    def unpin(self, kind: str, name: str) -> None:
        """Make ``name`` evictable again."""
        with self.step_lock:
            self.tiers[kind].unpin(name)

    def list(self, kind: str) -> list[str]:
        """Names of the CPU-cached adapters of ``kind``, least recently used first."""
        return self.tiers[kind].list()

    # ------------------------------------------------------------------ served names (the one registry)
    def serve(self, request, owner: str | None = None, replace: bool = False, load: bool = True,
              claim: Callable[[], bool] | None = None) -> ServedAdapter | None:
        """Serve ``request`` (a LoRA or prompt-adapter request) under its name, one namespace for both kinds.

        With ``load``, the adapter is loaded and validated first (its AdapterError raised, nothing
        served) into a version no request sees until it serves the name; without, the first request
        for it loads it. ``replace`` (load_inplace) serves it in place of an adapter of the same kind
        under that name, always as a new version read from what the source holds now (the same path
        may hold retrained files): the old one keeps serving until this one loaded, and its pin moves
        over. ``claim`` is asked right before the adapter becomes visible: False (the caller gave up
        waiting) leaves everything as it was. ``owner``: the tenant that loads it (None: the operator).

        Returns the served adapter (``version``: the version published now, when loaded), or None when
        ``claim`` said no. Raises ValueError when the name is served already (and ``replace`` is False,
        or it is served as the other kind). With ``load``, a LoRA's draft adapter (LoRARequest.
        draft_lora_path, with a draft model) is loaded and validated too: its AdapterError, nothing served.
        """
        kind = "lora" if isinstance(request, LoRARequest) else "prompt"
        if kind == "prompt":
            check_prompt_adapter_request(request, self.prompts_enabled)
        tier, other = self.tiers[kind], self.tiers["prompt" if kind == "lora" else "lora"]
        with _closed_as_engine_error():
            ref = tier.stage(request, fresh=replace) if load else None
        try:
            if ref is not None:
                self._add_draft(kind, request, fresh=replace)  # nothing served when its draft adapter is bad
            with self.step_lock:  # publishing retires the replaced version, which may free its slot
                if other.served(request.name) is not None:
                    raise ValueError(f"an adapter named {request.name!r} is already loaded (as a {other.kind})")
                if not tier.publish(ServedAdapter(request.name, request, owner), replace, ref, claim):
                    return None
        finally:
            if ref is not None:
                tier.release(ref)
        served = tier.served(request.name)
        # the version published here, even if another update published a newer one since
        return served if ref is None or served is None else dataclasses.replace(served, version=ref)

    def withdraw(self, name: str) -> ServedAdapter:
        """Stop serving ``name`` and retire its versions (running requests finish on their weights);
        UnknownAdapterError when it is not served."""
        with self.step_lock:
            tier = self.tiers["prompt"] if self.tiers["prompt"].served(name) is not None else self.tiers["lora"]
            return tier.withdraw(name)

    def served(self, name: str) -> ServedAdapter | None:
        """The adapter served under ``name`` (either kind), or None."""
        return self.tiers["lora"].served(name) or self.tiers["prompt"].served(name)

    def num_virtual_tokens(self, name: str) -> int | None:
        """The virtual tokens of the prompt adapter served as ``name``; None when none is, or its weights
        are not loaded now (the count is read from them)."""
        tier = self.tiers["prompt"]
        served = tier.served(name)
        if served is None or served.version is None:
            return None
        try:
            return tier.num_virtual_tokens(served.version)
        except ValueError:  # evicted or replaced since it was read
            return None

    def served_all(self) -> list[ServedAdapter]:
        """Every served adapter: LoRAs, then prompt adapters, each in the order first served."""
        return self.tiers["lora"].served_all() + self.tiers["prompt"].served_all()

    def close(self) -> None:
        """Cancel loads (their requests fail at the next step) and stop the loader threads, at once."""
        self.manager.close()

    # ------------------------------------------------------------------ a request's life
    def acquire(self, request: Request) -> None:
        """Start using the request's adapters (background loads); sets its refs.

        All or nothing: on any exception what was acquired is released and the refs are cleared.
        A prompt adapter that is ready already gets its placeholders now, and a prompt that no
        longer fits max_model_len raises ValueError.
        """
        try:
            with _closed_as_engine_error():
                if request.lora_request is not None:
                    request.lora_ref = self.tiers["lora"].acquire(request.lora_request)
                if request.prompt_adapter_request is not None:
                    request.prompt_adapter_ref = self.tiers["prompt"].acquire(request.prompt_adapter_request)
            request.adapter_versions = (request.lora_ref, request.prompt_adapter_ref)
            error = self._insert_if_ready(request)
            if error is not None:
                raise error
        except BaseException:
            self.release(request)
            raise

    def release(self, request: Request) -> None:
        """Let go of the request's adapters (it finished, or was never queued); clears its refs so a
        second release is a no-op rather than a release of someone else's hold."""
        for attr, kind in (("lora_ref", "lora"), ("prompt_adapter_ref", "prompt")):
            ref = getattr(request, attr)
            if ref is not None:
                setattr(request, attr, None)
                self.tiers[kind].release(ref)

    def failure(self, request: Request) -> BaseException | None:
        """The load error of the request's adapter that failed (LoRA first), or None."""
        for kind, ref in (("lora", request.lora_ref), ("prompt", request.prompt_adapter_ref)):
            if ref is not None and self.tiers[kind].state(ref) == "failed":
                return self.tiers[kind].error(ref)
        return None

    def insert_virtual_tokens(self, waiting: Iterable[Request]) -> None:
        """Insert placeholders into waiting requests whose prompt adapter finished loading.

        A request that would exceed max_model_len gets ``request.error``; the scheduler fails it.
        """
        for request in waiting:
            if request.awaiting_virtual_tokens and request.error is None:
                request.error = self._insert_if_ready(request)

    def activate(self, scheduled: list[ScheduledRequest]) -> tuple[dict[AdapterRef, int], dict[AdapterRef, int]]:
        """Make the step's LoRAs, and the soft prompts of chunks that contain placeholders, resident.

        Returns (LoRA ref -> slot, prompt-adapter ref -> slot). Call under ``step_lock``, right after
        the scheduler admitted the step within each tier's ``reserved_slots``. A ref whose slot write
        raised is missing from the maps (its version failed, see ``AdapterTier.activate``): ``place``
        names the requests that must leave the step."""
        loras = [s.request.lora_ref for s in scheduled if s.request.lora_ref is not None]
        prompts = [s.request.prompt_adapter_ref for s in scheduled if _needs_soft_prompt(s)]
        return self._activate("lora", loras), self._activate("prompt", prompts)

    def place(self, scheduled: list[ScheduledRequest]) -> Placement:
        """``activate`` as the scheduler asks for it (Scheduler.schedule's ``place``): the slots, and the
        requests an adapter of which got none, with that adapter's error. An adapter whose slot write raised
        fails its own requests only; any other failure here fails every picked request, which then never
        reaches the runner's rows."""
        try:
            slot_of, prompt_slot_of = self.activate(scheduled)
        except Exception as error:  # noqa: BLE001 - the step's requests fail; the step loop goes on
            logger.exception("making the step's adapters resident failed; failing its %d requests", len(scheduled))
            return Placement(unplaced={s.request: error for s in scheduled})
        unplaced = {}
        for s in scheduled:
            request = s.request
            if (request.lora_ref is not None and request.lora_ref not in slot_of
                    or _needs_soft_prompt(s) and request.prompt_adapter_ref not in prompt_slot_of):
                unplaced[request] = self.failure(request) or RuntimeError("its adapter got no device slot")
        return Placement(slot_of, prompt_slot_of, unplaced)

    def _activate(self, kind: str, refs: list[AdapterRef]) -> dict[AdapterRef, int]:
        refs = list(dict.fromkeys(refs))
        slots = self.tiers[kind].activate(refs) if refs else []
        return {ref: slot for ref, slot in zip(refs, slots) if slot is not None}

    def _insert_if_ready(self, request: Request) -> ValueError | None:
        ref, tier = request.prompt_adapter_ref, self.manager.prompts
        if ref is None or not request.awaiting_virtual_tokens or tier.state(ref) != "ready":
            return None
        num_virtual = tier.num_virtual_tokens(ref)
        if num_virtual + request.num_tokens > self.max_model_len:
            return ValueError(f"request {request.request_id!r}: prompt adapter {ref.name!r} adds {num_virtual} "
                              f"virtual tokens to a {request.num_tokens}-token prompt, more than max_model_len="
                              f"{self.max_model_len}")
        request.insert_virtual_tokens(num_virtual)
        logger.debug("request %r: %d soft-prompt placeholders of %r", request.request_id, num_virtual, ref.name)
        return None


def _needs_soft_prompt(scheduled: ScheduledRequest) -> bool:
    """True when the chunk holds soft-prompt placeholders, so its prompt adapter must be resident."""
    return scheduled.start < scheduled.request.num_virtual_tokens


@contextmanager
def _closed_as_engine_error():
    """A tier closed under a racing call raises EngineClosedError, as the engine documents."""
    try:
        yield
    except EngineClosedError:
        raise
    except TierClosedError as exc:
        raise EngineClosedError("the engine is closed") from exc
