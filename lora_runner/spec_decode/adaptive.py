"""Which requests speculate, and how many drafts they verify: the scheduler's DraftSource around a
proposer (n-gram lookup, or any other with ``num_speculative_tokens`` and ``drafts(request, budget)``).

- Every decoding request may speculate, whatever its settings: penalties, min_tokens, bad words and
  allowed ids are applied per verified position (lora_runner.sample.sampling_state, offsets), and a
  structured-output grammar gets one mask per position (lora_runner.spec_decode.grammar_masks).
- A constrained request's drafts are cut before the first one its grammar rejects (or after which
  it is complete), so no KV slot is spent on a draft that can never be kept.
- Acceptance: each request keeps an exponential moving average of its verify steps' acceptance rate
  (accepted / proposed drafts; EMA_WEIGHT on the newest step, starting at 1). Below
  ``min_acceptance_rate`` it stops proposing, and proposes once every ``acceptance_probe_interval``
  of its decode steps, whose verify step measures it anew: a request whose output does not repeat its
  input stops paying for drafts that miss, and one whose output starts to repeat resumes.
- Batch size: with ``disable_by_batch_size`` set, a step in which more requests decode than that
  verifies no drafts at all (vLLM's key; the scheduler reads it): a large batch is compute-bound
  already, and verifying drafts would only add work.

Which drafts are proposed never changes the tokens a request gets, only how many steps it takes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

from lora_runner.core.request import Request
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.grammar_masks import grammar_prefix

EMA_WEIGHT = 0.5  # the newest verify step's share of the acceptance average


class Proposer(Protocol):
    """Proposes draft tokens (lora_runner.spec_decode.ngram.Speculator)."""

    num_speculative_tokens: int  # k

    def prepare(self, running: list[Request]) -> None:
        """Once per step that may verify drafts, before any drafts() (a draft model's batched forwards)."""

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Up to k drafts after the request's last token within `budget` tokens (that one included)."""

    def release(self, request: Request) -> None:
        """`request` left the running set: what the proposer holds for it goes."""


@dataclass
class _Acceptance:
    """A request's recent acceptance: its EMA and the decode steps it waited since it paused."""

    rate: float = 1.0
    waited: int = 0


class SpeculationPolicy:
    """The scheduler's DraftSource (see the module docstring).

    Args:
        proposer: where drafts come from.
        config: the engine's SpeculativeConfig (its adaptation keys).
    """

    def __init__(self, proposer: Proposer, config: SpeculativeConfig) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self.min_acceptance_rate = config.min_acceptance_rate
        self.probe_interval = config.acceptance_probe_interval
        self._acceptance: weakref.WeakKeyDictionary[Request, _Acceptance] = weakref.WeakKeyDictionary()

    def prepare(self, running: list[Request]) -> None:
        """The proposer's step hook (DraftSource.prepare)."""
        self.proposer.prepare(running)

    def release(self, request: Request) -> None:
        """The proposer's per-request hook (DraftSource.release)."""
        self.proposer.release(request)

    def state(self, request: Request) -> str:
        """Whether what the proposer needs of a waiting request is loaded (DraftSource.state): its draft
        adapter (draft_model.DraftModelSpeculator.state); "ready" for a proposer that needs nothing (n-gram)."""
        state = getattr(self.proposer, "state", None)  # only a draft model loads anything per request
        return "ready" if state is None else state(request)

    def close(self) -> None:
        """The engine closed: the proposer's background work stops (a draft model's adapter loads)."""
        close = getattr(self.proposer, "close", None)
        if close is not None:
            close()

    def drafts(self, request: Request, budget: int) -> list[int]:
        """The request's drafts this step: [] while its acceptance is low (between probes), else the
        proposer's, cut to what its grammar accepts."""
        if not self._may_propose(request):
            return []
        drafts = self.proposer.drafts(request, budget)
        if drafts and request.grammar is not None:
            drafts = drafts[:grammar_prefix(request, drafts)]
        return drafts

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `request` accepted the first `num_accepted` of its `num_drafts` drafts."""
        acceptance = self._acceptance.setdefault(request, _Acceptance())
        acceptance.rate += EMA_WEIGHT * (num_accepted / num_drafts - acceptance.rate)

    def acceptance_rate(self, request: Request) -> float:
        """The request's acceptance average (1.0 before its first verify step)."""
        acceptance = self._acceptance.get(request)
        return 1.0 if acceptance is None else acceptance.rate

    def _may_propose(self, request: Request) -> bool:
        """False while the request's acceptance is below the threshold, except once every probe interval."""
        acceptance = self._acceptance.get(request)
        if acceptance is None or acceptance.rate >= self.min_acceptance_rate:
            return True
        acceptance.waited += 1
        if acceptance.waited < self.probe_interval:
            return False
        acceptance.waited = 0  # a probe: its verify step updates the average
        return True
