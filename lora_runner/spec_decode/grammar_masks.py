"""Structured-output constraints under speculative decoding: drafts cut to what the grammar accepts,
and one mask per verified position.

A constrained request's drafts are checked against its grammar when they are proposed
(``grammar_prefix``): the matcher is advanced by them in order and rolled back, and the drafts
stop before the first one the grammar rejects or after which it is complete (the request would end
there: the tokens after it could never be kept). So every scheduled draft continues the
constraint, and the verify step's position j samples under the mask the grammar has after the
request's tokens and its first j drafts (``position_bitmask``: advanced draft by draft while the
masks are filled, then rolled back). The matcher leaves both as it came; the output processor then
advances it by the tokens the step kept, one at a time, as without speculation.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from lora_runner.core.request import Request
from lora_runner.core.stop_rule import stop_tokens


def grammar_prefix(request: Request, drafts: Sequence[int]) -> int:
    """How many of `drafts` (in order) the request's grammar accepts before one it rejects or one
    that completes it; the grammar is left as it was (see the module docstring)."""
    grammar = request.grammar
    advanced = kept = 0
    try:
        for token_id in drafts:
            complete = grammar.accept(token_id)
            advanced += 1
            if complete:
                break
            kept += 1
    except ValueError:  # StructuredOutputError (a ValueError; engine/ is above this layer): rejected, or
        pass  # the request went over its mask budget: the drafts stop before it
    finally:
        grammar.rollback(advanced)
    return kept


def position_bitmask(sampled: Sequence[Request], drafts: Sequence[Sequence[int]], vocab_size: int,
                     mask_budget_s: float) -> tuple[list[int], torch.Tensor | None]:
    """(rows, bitmask [C, ceil(V / 32)] int32) of a step with draft tokens: `sampled` are its sampling
    requests in batch order and drafts[i] request i's drafts, so request i has len(drafts[i]) + 1
    verified positions in the step's sampled rows; `rows` holds the position index of each bitmask row
    (every position of a constrained request), ([], None) when none is constrained. A request whose
    masks take longer than `mask_budget_s` in all (its thread's CPU time, as StructuredOutputs'
    default clock) fails at its next token (RequestGrammar.over_budget)."""
    counts = [len(d) + 1 for d in drafts]
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    constrained = [i for i, request in enumerate(sampled) if request.grammar is not None]
    if not constrained:
        return [], None
    rows = [firsts[i] + j for i in constrained for j in range(counts[i])]
    # xgrammar's allocate_token_bitmask: every bit set (all allowed) until a fill writes the row
    bitmask = torch.full((len(rows), (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [C, W]
    index = 0
    for i in constrained:
        request, started = sampled[i], time.thread_time()
        _fill_positions(request, drafts[i], bitmask, index)
        index += counts[i]
        elapsed = time.thread_time() - started
        if elapsed > mask_budget_s:
            request.grammar.over_budget(elapsed, mask_budget_s)
    return rows, bitmask


def _fill_positions(request: Request, drafts: Sequence[int], bitmask: torch.Tensor, index: int) -> None:
    """Rows index..index + len(drafts) of `bitmask`: the request's mask after its first j drafts."""
    grammar, advanced = request.grammar, 0
    try:
        for j in range(len(drafts) + 1):
            eos_allowed = stop_tokens(request.params, request.num_output_tokens + j, ()).eos_allowed
            grammar.fill(bitmask, index + j, eos_allowed)
            if j < len(drafts):
                grammar.accept(drafts[j])  # continues the constraint: grammar_prefix checked it
                advanced += 1
    finally:
        grammar.rollback(advanced)
