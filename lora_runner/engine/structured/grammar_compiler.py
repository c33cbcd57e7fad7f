"""Constraint -> xgrammar CompiledGrammar, off the step thread, cached by (kind, text).

Parsing a JSON schema into a grammar and compiling the grammar's token masks can take seconds for a
large schema (xgrammar releases the GIL meanwhile), so both run in a small thread pool. The futures
are kept in a bounded LRU keyed by ``StructuredOutputsParams.key()``: requests with the same
constraint, parallel samples included, share one compilation, and one still in flight is never
started twice. xgrammar's own compiler cache is bounded in bytes as well.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from lora_runner.engine.structured.string_lengths import bounded_strings_as_patterns
from lora_runner.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # compilations that run at once (each is single-threaded)
CACHE_ENTRIES = 128  # compiled constraints kept (least recently used dropped first)
XGRAMMAR_CACHE_BYTES = 64 << 20  # bound of xgrammar's own compiler cache
# longest whitespace run between JSON tokens: unbounded, a model can stay in whitespace until max_tokens
MAX_JSON_WHITESPACE = 8


class StructuredOutputError(ValueError):
    """A request's structured-output constraint cannot be used: its schema, regex or grammar does not
    compile, or compiling it took longer than the engine allows. The request alone fails (a 400 over HTTP)."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary.

    Args:
        tokenizer: the model's transformers tokenizer (its vocabulary, decoded by xgrammar).
        vocab_size: the model's (padded) vocabulary: ids past the tokenizer's stay banned.
        stop_token_ids: the ids that end a request; a finished constraint allows only these.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Collection[int], *,
                 threads: int = COMPILE_THREADS, cache_entries: int = CACHE_ENTRIES) -> None:
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._futures: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_entries = cache_entries
        self._lock = threading.Lock()

    def compile(self, constraint: StructuredOutputsParams) -> Future:
        """The Future of `constraint`'s CompiledGrammar (shared with earlier requests of the same
        constraint); it raises StructuredOutputError when the constraint does not compile."""
        key = constraint.key()
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, *key)
            self._futures[key] = future
            while len(self._futures) > self._cache_entries:
                self._futures.popitem(last=False)
            return future

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        try:
            return self._compile_kind(kind, text)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / MemoryError with the reason
            raise StructuredOutputError(f"structured_outputs.{kind.removesuffix('_compact')} cannot be compiled: "
                                        f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
                                        ) from exc

    def _compile_kind(self, kind: str, text: str) -> xgr.CompiledGrammar:
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
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
