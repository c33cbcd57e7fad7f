"""Constraint -> xgrammar CompiledGrammar, off the step thread, cached per tenant by (kind, text).

Parsing a JSON schema into a grammar and compiling the grammar's token masks can take seconds for a
large schema (xgrammar releases the GIL meanwhile), so both run in compile threads (compile_queue):
each tenant's constraints wait in its own queue and the threads serve the tenants in turn; requests of
one tenant with the same constraint, parallel samples included, share one compilation. Compiled
grammars are bounded in bytes (xgrammar's ``CompiledGrammar.memory_size_bytes``) per tenant and in
total; one still compiling counts an estimate (``reserve_bytes``). xgrammar's own compiler cache is
bounded in bytes as well.

A compilation cannot be interrupted, so one that outlives ``timeout_s`` (a pathological constraint) fails
its requests at its deadline (a repeat fails at once from the cache) and its thread is replaced. At most
``MAX_STUCK_PER_TENANT`` such threads per tenant (``MAX_STUCK_COMPILES`` in all) may be outstanding; past
that, the tenant's (everyone's) new constraints are refused with StructuredOutputError until one of them
ends (unconstrained requests never wait on any of this).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from concurrent.futures import Future

from lora_runner.engine.structured.backend import StructuredOutputError, xgrammar
from lora_runner.engine.structured.compile_queue import CompileQueue
from lora_runner.engine.structured.string_lengths import bounded_strings_as_patterns
from lora_runner.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # compilations that run at once (each is single-threaded)
MAX_STUCK_COMPILES = 16  # compilations past their deadline whose threads may still be running, in all
MAX_STUCK_PER_TENANT = 4  # ... of one tenant (the old global bound: one tenant alone is served as before)
TENANT_CACHE_BYTES = 256 << 20  # EngineConfig.structured_outputs_tenant_cache_bytes's default
TOTAL_CACHE_BYTES = 1 << 30  # EngineConfig.structured_outputs_cache_bytes's default
CACHE_ENTRIES = 128  # compiled constraints kept (least recently used dropped first)
XGRAMMAR_CACHE_BYTES = 64 << 20  # bound of xgrammar's own compiler cache
# longest whitespace run between JSON tokens: unbounded, a model can stay in whitespace until max_tokens
MAX_JSON_WHITESPACE = 8


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary.

    Args:
        tokenizer: the model's transformers tokenizer (its vocabulary, decoded by xgrammar).
        vocab_size: the model's (padded) vocabulary: ids past the tokenizer's stay banned.
        stop_token_ids: the ids that end a request; a finished constraint allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], *,
                 threads: int = COMPILE_THREADS, cache_entries: int = CACHE_ENTRIES,
                 timeout_s: float | None = None, max_stuck: int = MAX_STUCK_COMPILES,
                 max_stuck_per_tenant: int = MAX_STUCK_PER_TENANT, tenant_bytes: int = TENANT_CACHE_BYTES,
                 total_bytes: int = TOTAL_CACHE_BYTES) -> None:
        self.vocab_size = vocab_size
        xgr = xgrammar()  # StructuredOutputError when it is not installed
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
        # a lambda, not the bound method: tests replace _compile_kind on the instance
        self.queue = CompileQueue(lambda kind, text: self._compile(kind, text), _compiled_bytes,
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

    def reserve_bytes(self, kind: str, text: str) -> int:
        """What a compilation counts until its real size is known: an estimate, as xgrammar tells the size
        only once it is compiled: 256 bytes per character of the constraint, at least 1 MiB (the per-tenant
        count of compilations in flight is what it bounds; the real size replaces it when it is known)."""
        return max(1 << 20, 256 * len(text))

    def _compile(self, kind: str, text: str):  # -> xgrammar.CompiledGrammar
        try:
            return self._compile_kind(kind, text)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / MemoryError with the reason
            raise StructuredOutputError(f"structured_outputs.{kind.removesuffix('_compact')} cannot be compiled: "
                                        f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
                                        ) from exc

    def _compile_kind(self, kind: str, text: str):  # -> xgrammar.CompiledGrammar
        compiler = self._compiler
        if kind in ("json", "json_compact"):
            text = json.dumps(bounded_strings_as_patterns(json.loads(text)))  # xgrammar's control characters
            return compiler.compile_json_schema(text, any_whitespace=kind == "json",
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if kind == "json" else None)
        if kind == "json_object":  # any JSON object (xgrammar's builtin JSON grammar takes any value)
            return compiler.compile_json_schema('{"type": "object"}', max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "grammar":
            return compiler.compile_grammar(text)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(json.loads(text)))
        raise StructuredOutputError(f"unknown structured_outputs kind {kind!r}")

    def close(self) -> None:
        """Stop taking compilations (running ones finish in their threads; nobody waits for them)."""
        self.queue.close()


def _compiled_bytes(compiled) -> int:
    """A CompiledGrammar's size in bytes, as xgrammar reports it (``memory_size_bytes``; an older xgrammar
    without it: the length of its serialized form, which holds the same grammar and token masks)."""
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if size is not None else len(compiled.serialize_json())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
