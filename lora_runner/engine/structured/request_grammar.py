"""One request's constraint while it runs: its compilation's Future, then its own Matcher (backend.Matcher).

The scheduler asks ``state()`` before admitting the request (as it asks an adapter's load state):
"loading" while the grammar compiles, "ready" once a matcher exists, "failed" (``error`` set) when
the compilation raised or outlived its deadline. The step thread fills the matcher's bitmask for
each step that samples the request; the output processor advances it by the sampled token. Every
parallel sample has its own RequestGrammar (matchers are stateful); a preempted request keeps its
matcher, since it keeps its tokens. The matcher's bytes (an estimate, Backend.matcher_bytes) count in its
tenant's grammar bytes from when it is made until the request is gone (``hold`` / ``release``); a
tenant whose bound is full fails the request with StructuredOutputError (a 400), as a grammar over it does.

min_tokens: while a request may not stop yet its end tokens are banned, and a constraint that is
complete and allows nothing but an end token would leave no token to sample. vLLM lets the end token
through in that case and the request ends with "stop" before min_tokens; here ``accept`` reports the
constraint complete as soon as it reaches that state, with the same outcome (the end token itself is
not sampled, so it is not among the output's token ids).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from lora_runner.engine.structured.backend import Matcher, StructuredOutputError, compile_timeout_error


class RequestGrammar:
    """The constraint of one request (see the module docstring). deadline: time.monotonic() after which a
    compilation still running fails the request; timeout_s: for the message; release: called once with the
    Future when the request is gone (GrammarCompiler.release); make_matcher: compiled grammar -> a fresh
    Matcher (Backend.matcher; None: xgrammar's); hold: compiled grammar -> the release of the bytes its matcher
    counts (GrammarCompiler.hold_matcher; StructuredOutputError when they do not fit)."""

    def __init__(self, future: Future, deadline: float, timeout_s: float,
                 release: Callable[[Future], None] = lambda future: None,
                 make_matcher: Callable[[object], Matcher] | None = None,
                 hold: Callable[[object], Callable[[], None]] = lambda compiled: lambda: None) -> None:
        if make_matcher is None:
            from lora_runner.engine.structured.xgrammar_backend import XGrammarMatcher as make_matcher
        self._future = future
        self._make_matcher = make_matcher
        self._release = release
        self._hold = hold
        self._unhold: Callable[[], None] | None = None  # gives back the matcher's bytes
        self._budget_error: StructuredOutputError | None = None
        self._deadline = deadline
        self._timeout_s = timeout_s
        self.matcher: Matcher | None = None  # once the compilation is done
        self.error: StructuredOutputError | None = None

    def state(self) -> str:
        """"ready", "loading" or "failed" (then ``error`` says why)."""
        if self.matcher is not None:
            return "ready"
        if self.error is not None:
            return "failed"
        if self._future.done():
            try:
                compiled = self._future.result()
                self._unhold = self._hold(compiled)  # before the matcher exists: over the bound, none is made
                self.matcher = self._make_matcher(compiled)
                return "ready"
            except StructuredOutputError as exc:
                self.error = exc
            except Exception as exc:  # noqa: BLE001 - a cancelled or broken compilation fails this request only
                self.error = StructuredOutputError(f"structured_outputs could not be compiled: {exc!r}")
            self._give_back()
            return "failed"
        if time.monotonic() > self._deadline:
            self.error = compile_timeout_error(self._timeout_s)
            return "failed"
        return "loading"

    def release(self) -> None:
        """The request is gone (finished, aborted): a compilation nobody else waits for is not started."""
        release, self._release = self._release, None
        if release is not None:
            release(self._future)
        self._give_back()

    def _give_back(self) -> None:
        """The matcher's bytes are no longer counted (once)."""
        unhold, self._unhold = self._unhold, None
        if unhold is not None:
            unhold()

    def over_budget(self, elapsed_s: float, budget_s: float, step: bool = False) -> None:
        """Its mask took `elapsed_s` in a step, over `budget_s` a request may take (`step`: it was the slowest
        of a step whose masks together took over the `budget_s` a step may): it fails at its next token."""
        over = (f"the slowest of a step whose masks together took over the {budget_s * 1000:g} ms a step may "
                "(structured_outputs_step_mask_budget_ms)" if step else
                f"over the {budget_s * 1000:g} ms a request may take")
        self._budget_error = StructuredOutputError(
            f"structured_outputs: computing the allowed tokens took {elapsed_s * 1000:.0f} ms in one step, {over}; "
            "simplify the constraint (an ambiguous grammar)")

    def fill(self, bitmask: torch.Tensor, index: int, eos_allowed: bool = True) -> None:
        """Write the ids the constraint allows next into row `index` of `bitmask` [C, ceil(V / 32)] int32;
        without its end tokens unless `eos_allowed` (ignore_eos and min_tokens: lora_runner.core.stop_rule)."""
        assert self.matcher is not None, "a request is sampled before its grammar is ready"
        self.matcher.fill(bitmask, index)
        self.filled(bitmask, index, eos_allowed)

    def filled(self, bitmask: torch.Tensor, index: int, eos_allowed: bool = True) -> None:
        """After its matcher wrote row `index` (``fill``, or the backend's batch: Backend.fill_batch): note a
        fill over the backend's own per-step bound, and ban the end tokens unless `eos_allowed`."""
        step_error = self.matcher.step_error()
        if step_error is not None and self._budget_error is None:  # the backend's own per-step bound
            self._budget_error = StructuredOutputError(
                f"structured_outputs: computing the allowed tokens went over the backend's per-step limits "
                f"({step_error.splitlines()[0]}); simplify the constraint (an ambiguous grammar)")
        if not eos_allowed:
            for token_id in self.matcher.stop_token_ids:
                bit = token_id % 32  # int32 words: bit 31 is the sign bit
                bitmask[index, token_id // 32] &= (1 << 31) - 1 if bit == 31 else ~(1 << bit)

    def accept(self, token_id: int, may_stop: bool = True) -> bool:
        """Advance by the sampled token; True when the constraint is complete: its end token was
        sampled or, while EOS may not end the request (`may_stop` False: min_tokens, ignore_eos), it allows
        nothing but an end token next (see the module docstring). StructuredOutputError when the
        token breaks the constraint (it was masked)."""
        assert self.matcher is not None, "a token is appended before the grammar is ready"
        if self._budget_error is not None:
            raise self._budget_error
        if self.matcher.is_terminated():
            return True
        if not self.matcher.accept_token(token_id):
            if self.only_end_allowed():  # every token was masked: the end tokens by min_tokens, the rest by us
                raise StructuredOutputError(
                    f"token {token_id} was sampled with every token masked: the output's constraint allowed only "
                    "an end token, which the request's min_tokens banned")
            raise StructuredOutputError(f"token {token_id} does not continue the output's constraint")
        return self.matcher.is_terminated() or (not may_stop and self.only_end_allowed())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` tokens ``accept`` advanced by (speculative decoding's drafts,
        lora_runner.spec_decode.grammar_masks)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def only_end_allowed(self) -> bool:
        """True when the constraint is complete and no token but an end token may follow (the grammar's
        own stop ids): a JSON value closed with no whitespace left, a choice written out."""
        return self.matcher.only_end_allowed()
