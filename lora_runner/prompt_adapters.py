"""The engine's prompt-adapter side: add/remove/pin/list, placeholder insertion and device slots.

A request with a prompt adapter (a PEFT prompt-tuning soft prompt) holds the adapter's AdapterRef
from add_request until it finishes, like a LoRA. Once the adapter is loaded, so that its number of
virtual tokens n is known, n placeholder tokens are put in front of the request's prompt: they take
positions 0..n-1 and the prompt n.., exactly as PEFT prepends its soft prompt, and the KV cache and
attention treat them as ordinary prompt tokens (max_model_len counts them). The batch builder maps
each placeholder to the adapter's device slot and virtual index, and the model's embedding step
overwrites the placeholder embeddings with the soft prompt. A soft prompt needs its slot only while
its placeholders are being computed: at the first prefill, and again when a preempted request
recomputes its tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

from adapters.request import PromptAdapterRequest
from adapters.tier import AdapterRef, PromptAdapterTier
from lora_runner.scheduler import ScheduledRequest
from lora_runner.sequence import Request

logger = logging.getLogger(__name__)


class EnginePromptAdapters:
    """Prompt adapters of one LLMEngine.

    Args:
        tier: the adapter manager's prompt-adapter tier (CPU cache, device slots, loading).
        lock: the engine's adapter lock; pins and removals wait for a step's schedule + activate.
        max_model_len: the engine's limit on placeholders + prompt + generated tokens.
        enabled: False when the engine has no prompt-adapter slots (max_prompt_adapters=0).
    """

    def __init__(self, tier: PromptAdapterTier, lock: threading.Lock, max_model_len: int, enabled: bool) -> None:
        self.tier, self._lock = tier, lock
        self.max_model_len, self.enabled = max_model_len, enabled
        self._pinned: set[str] = set()  # names pinned through the engine; guarded by lock

    # ------------------------------------------------------------------ the public calls
    def check(self, request: PromptAdapterRequest | None) -> None:
        """ValueError unless ``request`` is None or a PromptAdapterRequest this engine can serve."""
        if request is None:
            return
        if not isinstance(request, PromptAdapterRequest):
            raise ValueError(f"prompt_adapter_request must be a PromptAdapterRequest or None, got "
                             f"{type(request).__name__}")
        if not self.enabled:
            raise ValueError(f"prompt adapter {request.name!r}: prompt adapters are disabled; create the engine "
                             "with max_prompt_adapters > 0 and max_prompt_adapter_tokens > 0")

    def add(self, request: PromptAdapterRequest) -> AdapterRef:
        """Load and validate now; raises the adapter's AdapterError (ValueError if disabled)."""
        self.check(request)
        return self.tier.add(request)

    def remove(self, name: str) -> None:
        """Forget ``name``; deferred while requests hold it."""
        with self._lock:
            self.tier.remove(name)
            self._pinned.discard(name)

    def pin(self, name: str) -> None:
        """Keep ``name`` cached and, once resident, in its device slot."""
        with self._lock:
            self.tier.pin(name)
            self._pinned.add(name)

    def unpin(self, name: str) -> None:
        """Make a pinned prompt adapter evictable again."""
        with self._lock:
            self.tier.unpin(name)
            self._pinned.discard(name)

    def list(self) -> list[str]:
        """Names of the CPU-cached prompt adapters, least recently used first."""
        return self.tier.list()

    def reserved_slots(self, refs: set) -> int:
        """Device slots pinned adapters other than ``refs`` may hold (the scheduler calls this under lock)."""
        return len(self._pinned - {ref.name for ref in refs})

    # ------------------------------------------------------------------ a request's life
    def acquire(self, request: Request) -> None:
        """Start using the request's prompt adapter (background load); sets ``prompt_adapter_ref``.

        When the adapter is ready already, the placeholders are inserted now and a prompt that no
        longer fits max_model_len raises ValueError (the caller releases the ref).
        """
        if request.prompt_adapter_request is None:
            return
        request.prompt_adapter_ref = self.tier.acquire(request.prompt_adapter_request)
        error = self._insert_if_ready(request)
        if error is not None:
            raise error

    def insert_virtual_tokens(self, waiting: Iterable[Request]) -> None:
        """Insert placeholders into waiting requests whose adapter finished loading.

        A request that would exceed max_model_len gets ``request.error``; the scheduler fails it.
        """
        for request in waiting:
            if request.awaiting_virtual_tokens and request.error is None:
                request.error = self._insert_if_ready(request)

    def activate(self, scheduled: Iterable[ScheduledRequest]) -> dict[AdapterRef, int]:
        """Make resident the soft prompts of chunks that contain placeholders; ref -> device slot."""
        refs = list(dict.fromkeys(s.request.prompt_adapter_ref for s in scheduled
                                  if s.start < s.request.num_virtual_tokens))
        return dict(zip(refs, self.tier.activate(refs))) if refs else {}

    def release(self, request: Request) -> None:
        """The request finished (or was never queued): let go of its adapter."""
        if request.prompt_adapter_ref is not None:
            self.tier.release(request.prompt_adapter_ref)

    def _insert_if_ready(self, request: Request) -> ValueError | None:
        ref = request.prompt_adapter_ref
        if self.tier.state(ref) != "ready":
            return None
        num_virtual = self.tier.num_virtual_tokens(ref)
        if num_virtual + request.num_tokens > self.max_model_len:
            return ValueError(f"request {request.request_id!r}: prompt adapter {ref.name!r} adds {num_virtual} "
                              f"virtual tokens to a {request.num_tokens}-token prompt, more than max_model_len="
                              f"{self.max_model_len}")
        request.insert_virtual_tokens(num_virtual)
        logger.debug("request %r: %d soft-prompt placeholders of %r", request.request_id, num_virtual, ref.name)
        return None
