"""N-gram prompt lookup (vLLM's "ngram" method): draft tokens copied from the request's own tokens.

For n from prompt_lookup_max down to prompt_lookup_min, the last n tokens of the request (prompt and
output) are looked up among its earlier tokens; at the most recent earlier occurrence, the (up to) k
tokens that followed it are proposed. No model runs: a summary or an edit of a given text repeats
spans of it, and those spans are what gets proposed.

``Speculator`` proposes a running request's drafts, bounded by k, the step's token budget, the
request's max_tokens and max_model_len; which requests ask it, and when, is decided around it
(lora_runner.spec_decode.adaptive). Which drafts are proposed never changes the tokens a request
gets, only how many steps it takes.
"""

from __future__ import annotations

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


def draft_limit(request: Request, k: int, max_model_len: int) -> int:
    """The most drafts a decoding request may verify in its next step: at most k, and no more than it
    has tokens left to generate less one (the step yields at most drafts + 1 tokens, more would be
    wasted) nor past max_model_len (no KV slot there). Shared by every proposer."""
    return max(0, min(k, request.params.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens))


class Speculator:
    """N-gram drafts of a request (see the module docstring; the scheduler asks it through
    lora_runner.spec_decode.adaptive.SpeculationPolicy).

    Args:
        config: the engine's SpeculativeConfig.
        max_model_len: no draft may reach past it (its KV slot would not exist).
    """

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len

    @property
    def num_speculative_tokens(self) -> int:
        """k."""
        return self.config.num_speculative_tokens

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request whose one uncomputed token is scheduled, within `budget`
        tokens of the step (the last token included); [] when nothing repeats or there is no room."""
        limit = min(draft_limit(request, self.config.num_speculative_tokens, self.max_model_len), budget - 1)
        if limit < 1:
            return []
        tokens = np.asarray(request.token_ids[request.num_virtual_tokens:], np.int64)  # soft-prompt ids excluded
        return propose_ngram(tokens, limit, self.config.prompt_lookup_min, self.config.prompt_lookup_max)

    def prepare(self, running: list[Request]) -> None:
        """Nothing to prepare: n-gram drafts are looked up per request (DraftSource's step hook)."""

    def release(self, request: Request) -> None:
        """Nothing is held per request (DraftSource's hook)."""
