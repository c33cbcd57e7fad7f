"""N-gram prompt lookup (vLLM's "ngram" method): draft tokens copied from the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of the request (prompt and
output) are looked up among its earlier tokens; at the most recent earlier occurrence, the (up to) k
tokens that followed it are proposed. No model runs: a summary or an edit of a given text repeats
spans of it, and those spans are what gets proposed.

``Speculator`` is what the scheduler asks each step: whether a running request may speculate (see
``speculates``) and its drafts, bounded by k, the step's token budget, the request's max_tokens and
max_model_len. It adapts to each request's recent acceptance: after a verify step that accepted
none of its drafts a request proposes nothing for 1, then 3, 7, ... (at most MAX_BACKOFF_STEPS)
decode steps, and one accepted draft resets that; a request whose output does not repeat its
input stops paying for verifying drafts that miss. Which drafts are proposed never changes the
tokens a request gets, only how many steps it takes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from lora_runner.core.request import Request
from lora_runner.spec_decode.config import SpeculativeConfig


def propose_ngram(token_ids: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens of
    `token_ids` [L] (n from max_n down to min_n; the first n that occurs wins); [] when none occurs."""
    length = token_ids.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(token_ids[:length - 1], n)  # [L - n, n]: window i is tokens i..i+n-1
        hits = np.flatnonzero((windows == token_ids[length - n:]).all(axis=1))  # windows followed by a token
        if hits.size:
            follow = int(hits[-1]) + n
            return token_ids[follow:follow + k].tolist()
    return []


MAX_BACKOFF_STEPS = 16  # the longest run of decode steps without drafts after verify steps that missed


@dataclass
class _Backoff:
    """A request's recent misses: verify steps in a row that accepted no draft, and decode steps left to skip."""

    misses: int = 0
    skip: int = 0


def speculates(request: Request) -> bool:
    """True when the request's next token may be verified with drafts: its sampling settings are the
    same at every position of the verify step. Not for rows whose logits change with the tokens
    before them (see may_speculate) nor while min_tokens bans its stop ids; those decode one token
    per step."""
    return may_speculate(request) and request.num_output_tokens >= request.params.min_tokens


def may_speculate(request: Request) -> bool:
    """False for a request that never speculates: its logits change with the tokens before them
    (penalties, bad words, a structured-output grammar)."""
    params = request.params
    return (not params.has_penalties and not params.bad_words_token_ids and request.grammar is None
            and params.structured_outputs is None)


def draft_limit(request: Request, k: int, max_model_len: int) -> int:
    """The most drafts a decoding request may verify in its next step (0: none): at most k, none
    when it does not speculate (see speculates), and no more than it has tokens left to generate
    less one (the step yields at most drafts + 1 tokens) nor past max_model_len (no KV slot there)."""
    if not speculates(request):
        return 0
    return max(0, min(k, request.params.max_tokens - request.num_output_tokens - 1,
                      max_model_len - request.num_tokens))


class Speculator:
    """The scheduler's source of draft tokens (see the module docstring).

    Args:
        config: the engine's SpeculativeConfig.
        max_model_len: no draft may reach past it (its KV slot would not exist).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._backoff: weakref.WeakKeyDictionary[Request, _Backoff] = weakref.WeakKeyDictionary()

    @property
    def num_speculative_tokens(self) -> int:
        """k."""
        return self.config.num_speculative_tokens

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request whose one uncomputed token is scheduled, within `budget`
        tokens of the step (the last token included); [] when it does not speculate."""
        limit = min(draft_limit(request, self.config.num_speculative_tokens, self.max_model_len), budget - 1)
        if limit < 1:
            return []
        backoff = self._backoff.get(request)
        if backoff is not None and backoff.skip:
            backoff.skip -= 1
            return []
        tokens = np.asarray(request.token_ids[request.num_virtual_tokens:], np.int64)  # soft-prompt ids excluded
        return propose_ngram(tokens, limit, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def prepare(self, running: list[Request]) -> None:
        """Nothing to prepare: n-gram drafts are looked up per request (DraftSource's step hook)."""

    def release(self, request: Request) -> None:
        """Nothing held per request but its backoff, which outlives a preemption (DraftSource's hook)."""

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `request` accepted `num_accepted` of its `num_drafts` drafts (see the module
        docstring for how that sets its next proposals)."""
        backoff = self._backoff.setdefault(request, _Backoff())
        if num_accepted:
            backoff.misses = backoff.skip = 0
        else:
            backoff.misses += 1
            backoff.skip = min(2 ** backoff.misses - 1, MAX_BACKOFF_STEPS)
