"""Structured outputs (SamplingParams.structured_outputs) through xgrammar or llguidance, as vLLM V1 does it.

At add_request a constrained request gets a RequestGrammar whose grammar compiles in a thread pool
(grammar_compiler, cached by constraint); the scheduler admits it once the grammar is ready, or hands
it back failed. Each step the engine fills one bitmask row per sampled constrained request
(``step_bitmask``: plain tensor data that travels with the step) and the sampler bans what the rows
disallow; the output processor advances each matcher by its token, and a completed constraint ends
its request with "stop". A step without constrained requests has no bitmask at all, and an engine that
never sees a constraint imports no backend (backend.py: the interface; xgrammar_backend, guidance_backend).

Tenants: compilations are queued, cached and bounded in bytes per tenant (compile_queue); a request that
finishes before its compilation started drops it (``RequestGrammar.release``). Each request's mask fill is
timed: one over ``mask_budget_s`` fails that request alone at its next token, so an ambiguous grammar
costs the other requests one step at most instead of every step; and when a step's fills together pass
``step_budget_s``, its slowest fail the same way until the rest fit.
llguidance also bounds the work of each mask itself (its parser limits, set from the per-request budget:
guidance_backend.limits_for_budget).
"""

from __future__ import annotations

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
    """

    def __init__(self, get_tokenizer: Callable, vocab_size: int, stop_token_ids: Callable[[], Collection[int]],
                 wake: Callable[[], None] = lambda: None, *, timeout_s: float, tenant_bytes: int = TENANT_CACHE_BYTES,
                 total_bytes: int = TOTAL_CACHE_BYTES, mask_budget_s: float = 0.25, step_budget_s: float = 0.5,
                 clock: Callable[[], float] = time.thread_time, backend: str = "auto") -> None:
        self.backend = backend
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
                                 release=compiler.release, make_matcher=compiler.backend.matcher)
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
        costs = []  # (seconds, request) of each fill within the per-request budget
        for index, row in enumerate(rows):
            request = sampled[row]
            start = self._clock()
            request.grammar.fill(bitmask, index, stop_tokens(request.params, request.num_output_tokens, ()).eos_allowed)
            elapsed = self._clock() - start
            if elapsed > self.mask_budget_s:  # it fails at its next token (RequestGrammar.accept), alone
                request.grammar.over_budget(elapsed, self.mask_budget_s)
            else:
                costs.append((elapsed, request))
        self._over_step_budget(costs)
        return rows, bitmask

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
