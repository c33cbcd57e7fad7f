"""Constraint -> xgrammar CompiledGrammar, off the step thread, cached by (kind, text).

Parsing a JSON schema into a grammar and compiling the grammar's token masks can take seconds for a
large schema (xgrammar releases the GIL meanwhile), so both run in a small thread pool. The futures
are kept in a bounded LRU keyed by ``StructuredOutputsParams.key()``: requests with the same
constraint, parallel samples included, share one compilation, and one still in flight is never
started twice. xgrammar's own compiler cache is bounded in bytes as well.

A compilation cannot be interrupted, so one that outlives ``timeout_s`` (a pathological constraint) would
hold its thread for good: at its deadline it fails its Future (requests of that constraint fail alone, a
repeat fails at once from the cache) and gives its compile slot back, so the next constraints compile in a
fresh thread. At most ``MAX_STUCK_COMPILES`` such threads may be outstanding; past that, new constraints are
refused with StructuredOutputError until one of them ends (unconstrained requests never wait on any of this).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor

from lora_runner.engine.structured.backend import StructuredOutputError, compile_timeout_error, xgrammar
from lora_runner.engine.structured.string_lengths import bounded_strings_as_patterns
from lora_runner.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

COMPILE_THREADS = 2  # compilations that run at once (each is single-threaded)
MAX_STUCK_COMPILES = 4  # compilations past their deadline whose threads may still be running
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
                 timeout_s: float | None = None, max_stuck: int = MAX_STUCK_COMPILES) -> None:
        self.vocab_size = vocab_size
        xgr = xgrammar()  # StructuredOutputError when it is not installed
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                                 stop_token_ids=sorted(stop_token_ids) or None)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=1, cache_enabled=True,
                                             cache_limit_bytes=XGRAMMAR_CACHE_BYTES)
        # `threads` compile slots; threads whose compilation outlived its deadline gave theirs back
        self._pool = ThreadPoolExecutor(threads + max_stuck, thread_name_prefix="grammar-compile")
        self._slots = threading.Semaphore(threads)
        self._timeout_s, self._max_stuck = timeout_s, max_stuck
        self.num_stuck = 0  # compilations past their deadline still running in their threads
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
            if self.num_stuck >= self._max_stuck:
                raise StructuredOutputError(
                    f"{self.num_stuck} earlier constraints are still compiling past their deadline; try again later "
                    "or simplify the constraint")
            future = Future()  # ours, not the pool's: a deadline can fail it while its thread still runs
            self._pool.submit(self._run, future, key)
            self._futures[key] = future
            while len(self._futures) > self._cache_entries:
                self._futures.popitem(last=False)
            return future

    def _run(self, future: Future, key: tuple[str, str]) -> None:
        """Compile `key` in a compile slot into `future`. Past its deadline `_overdue` fails the future and
        gives the slot back; the thread then only counts as stuck until the compilation ends."""
        self._slots.acquire()
        if not future.set_running_or_notify_cancel():
            self._slots.release()
            return
        overdue = threading.Event()  # set once: by the deadline, or by the end of the compilation
        timer = None
        if self._timeout_s is not None:
            timer = threading.Timer(self._timeout_s, self._overdue, (future, overdue))
            timer.daemon = True
            timer.start()
        try:
            result, error = self._compile(*key), None
        except StructuredOutputError as exc:
            result, error = None, exc
        finally:
            if timer is not None:
                timer.cancel()
        with self._lock:
            if overdue.is_set():  # the deadline came first: its future failed and its slot went back
                self.num_stuck -= 1
                logger.warning("a structured-output compilation (%s) ended after its deadline", key[0])
                return
            overdue.set()
        self._slots.release()
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def _overdue(self, future: Future, overdue: threading.Event) -> None:
        """The deadline of a running compilation: fail its future and give its compile slot back."""
        with self._lock:
            if overdue.is_set():  # it ended first
                return
            overdue.set()
            self.num_stuck += 1
        self._slots.release()
        logger.warning("a structured-output compilation outlived its %g s deadline; its thread is left to finish",
                       self._timeout_s)
        future.set_exception(compile_timeout_error(self._timeout_s))

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
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string literals are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
