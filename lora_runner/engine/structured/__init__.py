"""Structured outputs (SamplingParams.structured_outputs) through xgrammar or llguidance, as vLLM V1 does it.

At add_request a constrained request gets a RequestGrammar whose grammar compiles in a thread pool
(grammar_compiler, cached by constraint); the scheduler admits it once the grammar is ready, or hands
it back failed. Each step the engine fills one bitmask row per sampled constrained request
(``step_bitmask``: plain tensor data that travels with the step) and the sampler bans what the rows
disallow; the output processor advances each matcher by its token, and a completed constraint ends
its request with "stop". A step without constrained requests has no bitmask at all, and an engine that
never sees a constraint imports no backend (backend.py: the interface; xgrammar_backend, guidance_backend).

Tenants: compilations are queued, cached and bounded in bytes per tenant (compile_queue), and so are the
live requests' matchers (an estimate each, from when the matcher is made until its request ends); a request
that finishes before its compilation started drops it (``RequestGrammar.release``).

Mask budgets. Filled one by one, each request's fill is timed (the step thread's CPU time): one over
``mask_budget_s`` fails that request alone at its next token, so an ambiguous grammar costs the other
requests one step at most instead of every step; and when a step's fills together pass ``step_budget_s``,
its slowest fail the same way until the rest fit. llguidance also bounds the work of each mask itself (its
parser limits, set from the per-request budget: guidance_backend.limits_for_budget), and fills a step's
rows together in its own threads (Backend.fill_batch), which report no per-row cost: there the per-request
bound is llguidance's limits alone, and a batch whose wall time passes ``step_budget_s`` makes the next
step fill one by one, timed, so the slowest are found and failed as above (then batches resume).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence

import torch

from lora_runner.core.request import Request
from lora_runner.core.stop_rule import stop_tokens
from lora_runner.engine.structured.backend import StructuredOutputError
from lora_runner.engine.structured.grammar_compiler import TENANT_CACHE_BYTES, TOTAL_CACHE_BYTES, GrammarCompiler
from lora_runner.engine.structured.request_grammar import RequestGrammar
from lora_runner.sampling_params import SamplingParams

__all__ = ["StructuredOutputs", "StructuredOutputError", "RequestGrammar", "grammar_state"]

logger = logging.getLogger(__name__)


class StructuredOutputs:
    """The engine's structured-output seam.

    Args:
        get_tokenizer: () -> the model's transformers tokenizer or None (loaded on the first constrained
            request; a model without one refuses constraints with ValueError).
        vocab_size: the model's vocabulary (bitmask width).
        stop_token_ids: () -> the ids that end a request (the engine's EOS ids when the compiler is made).
        wake: called when a compilation finishes or times out, so an idle step loop looks again.
        timeout_s: a constraint still compiling after this fails its request
            (EngineConfig.structured_outputs_compile_timeout_s).
        tenant_bytes / total_bytes: the compiled grammars' bounds (EngineConfig.structured_outputs_*cache_bytes).
        mask_budget_s: the time one request's mask fill may take in a step (structured_outputs_mask_budget_ms).
        step_budget_s: the time all of a step's mask fills may take together (structured_outputs_step_mask_budget_ms);
            over it the slowest fail, as over mask_budget_s, until the rest fit.
        backend: "auto", "xgrammar" or "guidance" (EngineConfig.structured_outputs_backend).
        clock: the time source of the mask budget: the step thread's CPU time, so that a step thread merely
            descheduled on a busy host fails nobody (tests inject one).
        batch_clock / parallel_fill: the time source of a batch fill (wall time: its work runs on other threads),
            and whether the backend's batch fill is used (off: every step fills one by one).
    """

    def __init__(self, get_tokenizer: Callable, vocab_size: int, stop_token_ids: Callable[[], Collection[int]],
                 wake: Callable[[], None] = lambda: None, *, timeout_s: float, tenant_bytes: int = TENANT_CACHE_BYTES,
                 total_bytes: int = TOTAL_CACHE_BYTES, mask_budget_s: float = 0.25, step_budget_s: float = 0.5,
                 clock: Callable[[], float] = time.thread_time, backend: str = "auto",
                 batch_clock: Callable[[], float] = time.monotonic, parallel_fill: bool = True) -> None:
        self.backend = backend
        # batches (Backend.fill_batch) run on the backend's threads: timed by the wall clock, which only
        # decides whether the next step is filled one by one (timed by `clock`, which fails requests)
        self.parallel_fill, self._batch_clock = parallel_fill, batch_clock
        self._serial_next = False  # the last batch passed step_budget_s: the next step times each fill
        self.tenant_bytes, self.total_bytes = tenant_bytes, total_bytes
        self.mask_budget_s, self.step_budget_s, self._clock = mask_budget_s, step_budget_s, clock
        self._get_tokenizer = get_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._wake = wake
        self.timeout_s = timeout_s
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The grammar compiler, made on first use; ValueError when the model has no tokenizer."""
        with self._lock:
            if self._compiler is None:
                tokenizer = self._get_tokenizer()
                if tokenizer is None:
                    raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
                self._compiler = GrammarCompiler(tokenizer, self.vocab_size, self._stop_token_ids(),
                                                 timeout_s=self.timeout_s, tenant_bytes=self.tenant_bytes,
                                                 total_bytes=self.total_bytes, backend=self.backend,
                                                 mask_budget_s=self.mask_budget_s)
            return self._compiler

    def request_grammar(self, params: SamplingParams, tenant: str = "") -> RequestGrammar | None:
        """A new RequestGrammar for `tenant`'s request with these params (None when unconstrained); its
        compilation is queued now (or shared with the tenant's earlier one of the same constraint)."""
        if params.structured_outputs is None:
            return None
        compiler = self.compiler
        requested = params.structured_outputs.backend
        if requested not in (None, "auto") and requested != compiler.backend.name:  # vLLM V1 refuses it too
            raise ValueError(f"structured_outputs.backend={requested!r} differs from this server's backend "
                             f"{compiler.backend.name!r}: a request cannot choose its backend; leave it out (the "
                             "server's: EngineConfig.structured_outputs_backend, serve --structured-outputs-backend)")
        future = compiler.compile(params.structured_outputs, tenant)
        grammar = RequestGrammar(future, time.monotonic() + self.timeout_s, self.timeout_s,
                                 release=compiler.release, make_matcher=compiler.backend.matcher,
                                 hold=lambda compiled: compiler.hold_matcher(compiled, tenant))
        if not future.done():
            future.add_done_callback(lambda _: self._wake())
            timer = threading.Timer(self.timeout_s, self._wake)  # the deadline wakes an idle loop too
            timer.daemon = True
            timer.start()
        return grammar

    def step_bitmask(self, sampled: Sequence[Request]) -> tuple[list[int], torch.Tensor | None]:
        """(rows, bitmask [C, ceil(V / 32)] int32) for the step's sampled requests (batch order): the
        rows (indices into `sampled`) of the constrained ones and what each may sample next; ([], None)
        when none is constrained."""
        rows = [i for i, request in enumerate(sampled) if request.grammar is not None]
        if not rows:
            return [], None
        bitmask = torch.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=torch.int32)  # [C, W]: all allowed
        requests = [sampled[row] for row in rows]
        if not self._fill_batch(requests, bitmask):
            self._fill_each(requests, bitmask)
        return rows, bitmask

    def _fill_batch(self, requests: list[Request], bitmask: torch.Tensor) -> bool:
        """All rows at once by the backend's threads (two rows or more, unless the last batch passed the step
        budget); False when they are to be filled one by one instead."""
        serial, self._serial_next = self._serial_next, False
        if serial or not self.parallel_fill or len(requests) < 2:
            return False
        start = self._batch_clock()
        if not self.compiler.backend.fill_batch([(r.grammar.matcher, i) for i, r in enumerate(requests)], bitmask):
            return False
        elapsed = self._batch_clock() - start
        for index, request in enumerate(requests):
            request.grammar.filled(bitmask, index, _eos_allowed(request))
        if elapsed > self.step_budget_s:  # no per-row cost: the next step times each fill to find the slowest
            logger.info("structured outputs: %d masks filled together took %.0f ms, over the %g ms a step may; "
                        "the next step fills them one by one", len(requests), elapsed * 1000,
                        self.step_budget_s * 1000)
            self._serial_next = True
        return True

    def _fill_each(self, requests: list[Request], bitmask: torch.Tensor) -> None:
        """Each row in turn, timed: over mask_budget_s a request fails alone, and over step_budget_s together the
        slowest fail (_over_step_budget)."""
        costs = []  # (seconds, request) of each fill within the per-request budget
        for index, request in enumerate(requests):
            start = self._clock()
            request.grammar.fill(bitmask, index, _eos_allowed(request))
            elapsed = self._clock() - start
            if elapsed > self.mask_budget_s:  # it fails at its next token (RequestGrammar.accept), alone
                request.grammar.over_budget(elapsed, self.mask_budget_s)
            else:
                costs.append((elapsed, request))
        self._over_step_budget(costs)

    def _over_step_budget(self, costs: list[tuple[float, Request]]) -> None:
        """Many fills each under mask_budget_s may still slow the step for everyone together: over
        step_budget_s, the slowest fail (at their next token, as over mask_budget_s) until the rest fit."""
        total = sum(elapsed for elapsed, _ in costs)
        for elapsed, request in sorted(costs, key=lambda cost: -cost[0]):
            if total <= self.step_budget_s:
                return
            request.grammar.over_budget(elapsed, self.step_budget_s, step=True)
            total -= elapsed

    def close(self) -> None:
        """Stop the compile threads (compilations in flight are left to finish on their own)."""
        if self._compiler is not None:
            self._compiler.close()


def _eos_allowed(request: Request) -> bool:
    """False while ignore_eos or min_tokens holds (lora_runner.core.stop_rule): its end tokens are masked."""
    return stop_tokens(request.params, request.num_output_tokens, ()).eos_allowed


def grammar_state(request: Request) -> str:
    """The scheduler's view of a request's grammar: "ready" (or none), "loading", "failed" (then
    request.error is set to the reason)."""
    grammar = request.grammar
    if grammar is None:
        return "ready"
    state = grammar.state()
    if state == "failed":
        request.error = grammar.error
    return state
