"""The one rule for "may this request stop now, and by which token ids" (min_tokens, EOS, stop ids).

Both sides of a step read it: the sampling side bans a request's stop ids while it may not stop
yet (so an early EOS or stop token is never generated, as vLLM does), and the output processor
(lora_runner.engine.output_processor) ends a request on a sampled stop id only when the same rule
allowed it. A token's rule is the one at the count of tokens generated before it: min_tokens
tokens come before any EOS or stop id.

A structured-output constraint ends on its end token, which is EOS: while ignore_eos or min_tokens
holds, EOS may not end the request, so the constraint's mask leaves it out (``eos_allowed``) and
the constraint ends only where it allows nothing else (vLLM's semantics).
"""

from __future__ import annotations

from collections.abc import Collection

from lora_runner.sampling_params import SamplingParams


class StopTokens:
    """The ids that end a request and whether they may end it yet.

    A small object made per sampled token on the host step, so it stores what it needs and builds
    the id set only when asked for it (``ids``, ``banned``); ``stops`` tests membership directly."""

    __slots__ = ("params", "eos_token_ids", "may_stop")

    def __init__(self, params: SamplingParams, eos_token_ids: Collection[int], may_stop: bool) -> None:
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.may_stop = may_stop  # min_tokens generated already: a stop id (or a stop string) may end it

    @property
    def ids(self) -> frozenset[int]:
        """Its stop_token_ids and, unless ignore_eos, the model's EOS ids."""
        eos = frozenset() if self.params.ignore_eos else frozenset(self.eos_token_ids)
        return frozenset(self.params.stop_token_ids) | eos

    @property
    def banned(self) -> frozenset[int]:
        """The ids the next token may not be: every stop id while the request may not stop yet."""
        return frozenset() if self.may_stop else self.ids

    @property
    def eos_allowed(self) -> bool:
        """Whether EOS may end the request now: it generated min_tokens tokens and has no ignore_eos."""
        return self.may_stop and not self.params.ignore_eos

    def stops(self, token_id: int) -> bool:
        """True when `token_id` ends the request (`token_id in ids` once it may stop)."""
        return self.may_stop and (token_id in self.params.stop_token_ids
                                  or (not self.params.ignore_eos and token_id in self.eos_token_ids))


def stop_tokens(params: SamplingParams, num_generated: int, eos_token_ids: Collection[int]) -> StopTokens:
    """The stop rule for a request's next token after `num_generated` generated tokens."""
    return StopTokens(params, eos_token_ids, num_generated >= params.min_tokens)
