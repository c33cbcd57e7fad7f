"""Constraint -> compiled grammar (by the engine's backend), off the step thread, cached per tenant by (kind, text).

Compiling a constraint can take seconds for a large schema (xgrammar precomputes token masks; llguidance
compiles lazily), so it runs in compile threads (compile_queue): each tenant's constraints wait in its own
queue and the threads serve the tenants in turn; requests of one tenant with the same constraint, parallel
samples included, share one compilation. Compiled grammars are bounded in bytes (``Backend.size_of``) per
tenant and in total; one still compiling counts an estimate (``reserve_bytes``).

A compilation cannot be interrupted, so one that outlives ``timeout_s`` (a pathological constraint) fails
its requests at its deadline (a repeat fails at once from the cache) and its thread is replaced. At most
``MAX_STUCK_PER_TENANT`` such threads per tenant (``MAX_STUCK_COMPILES`` in all) may be outstanding; past
that, the tenant's (everyone's) new constraints are refused with StructuredOutputError until one of them
ends (unconstrained requests never wait on any of this).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from concurrent.futures import Future

from lora_runner.engine.structured.backend import Backend, StructuredOutputError, resolve_backend
from lora_runner.engine.structured.compile_queue import CompileQueue
from lora_runner.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # compilations that run at once (each is single-threaded)
MAX_STUCK_COMPILES = 16  # compilations past their deadline whose threads may still be running, in all
MAX_STUCK_PER_TENANT = 4  # ... of one tenant (the old global bound: one tenant alone is served as before)
TENANT_CACHE_BYTES = 256 << 20  # EngineConfig.structured_outputs_tenant_cache_bytes's default
TOTAL_CACHE_BYTES = 1 << 30  # EngineConfig.structured_outputs_cache_bytes's default
CACHE_ENTRIES = 128  # compiled constraints kept (least recently used dropped first)


def make_backend(name: str, tokenizer, vocab_size: int, stop_token_ids: Collection[int],
                 mask_budget_s: float = 0.25) -> Backend:
    """The backend `name` ("auto", "xgrammar", "guidance") for this tokenizer and vocabulary; StructuredOutputError
    when its package is not installed or it cannot read the tokenizer ("auto" then tries xgrammar)."""
    if resolve_backend(name) == "guidance":
        from lora_runner.engine.structured.guidance_backend import GuidanceBackend

        try:
            return GuidanceBackend(tokenizer, vocab_size, stop_token_ids, mask_budget_s=mask_budget_s)
        except StructuredOutputError as exc:
            if name != "auto":
                raise
            logger.warning("structured outputs: %s; using xgrammar instead", exc)
    from lora_runner.engine.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, stop_token_ids)


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, with the backend `backend` names.

    Args:
        tokenizer: the model's transformers tokenizer (its vocabulary, decoded by the backend).
        vocab_size: the model's (padded) vocabulary: ids past the tokenizer's stay banned.
        stop_token_ids: the ids that end a request; a finished constraint allows only these.
        backend: "auto", "xgrammar" or "guidance" (EngineConfig.structured_outputs_backend).
        mask_budget_s: the per-request mask budget, which sets llguidance's own per-step limits.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], *,
                 threads: int = COMPILE_THREADS, cache_entries: int = CACHE_ENTRIES,
                 timeout_s: float | None = None, max_stuck: int = MAX_STUCK_COMPILES,
                 max_stuck_per_tenant: int = MAX_STUCK_PER_TENANT, tenant_bytes: int = TENANT_CACHE_BYTES,
                 total_bytes: int = TOTAL_CACHE_BYTES, backend: str = "auto", mask_budget_s: float = 0.25) -> None:
        self.vocab_size = vocab_size
        self.backend = make_backend(backend, tokenizer, vocab_size, stop_token_ids, mask_budget_s)
        # a lambda, not the bound method: tests replace _compile_kind on the instance
        self.queue = CompileQueue(lambda kind, text: self._compile(kind, text), self.backend.size_of,
                                  self.reserve_bytes, threads=threads, timeout_s=timeout_s,
                                  tenant_bytes=tenant_bytes, total_bytes=total_bytes,
                                  max_stuck_per_tenant=max_stuck_per_tenant, max_stuck=max_stuck,
                                  max_entries=cache_entries)

    @property
    def num_stuck(self) -> int:
        """Compilations past their deadline whose threads still run."""
        return self.queue.num_stuck

    @property
    def _max_stuck(self) -> int:
        return self.queue.max_stuck

    @_max_stuck.setter
    def _max_stuck(self, value: int) -> None:
        self.queue.max_stuck = value

    def compile(self, constraint: StructuredOutputsParams, tenant: str = "") -> Future:
        """The Future of `constraint`'s CompiledGrammar for `tenant` (shared with the tenant's earlier
        requests of the same constraint); it raises StructuredOutputError when the constraint does not
        compile, and compile itself raises it when the constraint is refused up front (compile_queue)."""
        return self.queue.submit(constraint.key(), tenant)

    def release(self, future: Future) -> None:
        """A request waiting on `future` is gone: a compilation nobody waits for is dropped before it starts."""
        self.queue.release(future)

    def hold_matcher(self, compiled, tenant: str = ""):
        """Count the bytes a request's matcher of `compiled` holds (Backend.matcher_bytes) to `tenant` until the
        returned release is called; StructuredOutputError, naming the setting, over the tenant's or total bound."""
        return self.queue.hold(tenant, self.backend.matcher_bytes(compiled))

    def reserve_bytes(self, kind: str, text: str) -> int:
        """What a compilation counts until its real size is known (Backend.reserve_bytes)."""
        return self.backend.reserve_bytes(kind, text)

    def _compile(self, kind: str, text: str):  # -> the backend's compiled grammar
        try:
            return self._compile_kind(kind, text)
        except StructuredOutputError:
            raise
        except Exception as exc:  # the backends raise RuntimeError / ValueError / MemoryError with the reason
            raise StructuredOutputError(f"structured_outputs.{kind.removesuffix('_compact')} cannot be compiled: "
                                        f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
                                        ) from exc

    def _compile_kind(self, kind: str, text: str):
        return self.backend.compile(kind, text)

    def close(self) -> None:
        """Stop taking compilations (running ones finish in their threads; nobody waits for them)."""
        self.queue.close()
