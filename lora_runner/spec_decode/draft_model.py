"""Draft-model proposals (vLLM's "draft_model" method): a smaller model with the target's tokenizer
proposes its greedy tokens.

The draft runs without adapters, or with each request's own draft adapter where its LoRARequest names
one (``draft_lora_path``, lora_runner.spec_decode.draft_adapters), in the engine process beside the
scheduler (at tensor_parallel_size > 1 too: unsharded, on the engine's side, not on the target's ranks),
with its own paged KV cache: a block table per request from its own BlockManager, freed when the request
finishes or is preempted (``release``). The draft reads a request's real tokens (soft-prompt placeholders
excluded: the draft has no soft prompt); what its cache holds for a request is the list of tokens it
computed (``_DraftState.cached``, positions 0..), with its draft adapter if it has one (no prefix caching:
no KV is shared between requests).

Each step (``prepare``, the scheduler's hook, with the running requests):

1. rollback: each request's cached tokens are cut back to the longest prefix that agrees with its
   tokens now, so the draft's KV holds exactly accepted tokens before it proposes (the drafts it fed
   itself and the target rejected go; their slots are written again);
2. one forward over all requests at once: each catches up to the tokens the target has computed (the
   target's chunked prefill never leaves the draft more than a step behind; a prefix-cache hit, which
   the draft cannot share, is computed here in chunks of the step's budget), and each decoding request
   that may speculate (ngram.draft_limit) also feeds its last token and takes the draft's argmax
   there: its first proposal; requests that may propose go first, oldest first; with draft adapters, each
   row runs with its own (slot -1: none), and a request whose draft adapter got no slot this step sits
   it out (DraftAdapters.slots);
3. k - 1 more forwards of one token per proposing request: each feeds its previous proposal and takes
   the argmax after it, until its own limit (max_tokens, max_model_len).

So a step runs k draft forwards at most, each batched over every speculating row. ``drafts()`` then
hands out each request's proposals, cut to the step's budget.

Exactness: a proposal is deterministic (the argmax), so the draft distribution q of rejection sampling
is one-hot at it. The rejection sampler (lora_runner.spec_decode.rejection_sampler) treats every draft
as such a point mass: it accepts x with probability p(x) and on rejection samples
normalize(max(p - onehot(x), 0)), which is Leviathan et al.'s rule for that q. The target's output
distribution is therefore exactly preserved for sampled requests, and greedy ones keep their tokens.
A draft forward that raises costs only speculation: the states are dropped and the step goes on without
proposals.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.draft_adapters import DraftAdapters
from lora_runner.spec_decode.ngram import draft_limit

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftChunk:
    """One sequence's part of a draft forward: tokens token_ids[start:start + num_new_tokens], their
    K/V written at those positions through block_table; sample: return the argmax after its last token."""

    token_ids: list[int]  # the sequence's tokens as the draft sees them; not copied
    start: int  # tokens already in the draft's cache
    num_new_tokens: int
    block_table: list[int]  # the draft's blocks covering positions [0, start + num_new_tokens)
    sample: bool
    lora_slot: int = -1  # the draft model's LoRA slot of the request's draft adapter; -1: none


class DraftForward(Protocol):
    """The draft model's forward (lora_runner.worker.draft_runner.DraftModelRunner)."""

    def __call__(self, chunks: Sequence[DraftChunk]) -> list[int]:
        """Writes every chunk's K/V; returns the greedy token after each sampling chunk, in order."""


@dataclass
class _DraftState:
    """What the draft's cache holds for one request."""

    cached: list[int] = field(default_factory=list)  # tokens whose K/V it holds, positions 0..
    confirmed: int = 0  # leading cached tokens known to be the request's own; after them, proposals fed back


@dataclass
class _Proposing:
    """A request proposing this step."""

    request_id: str
    state: _DraftState
    limit: int  # the most proposals it may make
    lora_slot: int  # its draft adapter's slot this step (-1: none)
    tokens: list[int] = field(default_factory=list)  # its proposals so far


def check_same_vocab(draft_name: str, target_vocab_size: int, draft_vocab_size: int,
                     target_tokens: Mapping[str, int] | None, draft_tokens: Mapping[str, int] | None) -> None:
    """ValueError unless the draft can propose the target's token ids: the same vocabulary size and,
    where both have a tokenizer, the same token -> id map."""
    if draft_vocab_size != target_vocab_size:
        problem = f"its vocab_size is {draft_vocab_size}, the model's {target_vocab_size}"
    elif target_tokens is not None and draft_tokens is not None and target_tokens != draft_tokens:
        differ = sum(1 for token, i in draft_tokens.items() if target_tokens.get(token) != i)
        problem = (f"its tokenizer maps {differ} tokens to other ids than the model's "
                   f"({len(draft_tokens)} vs {len(target_tokens)} tokens)")
    else:
        return
    raise ValueError(f"speculative_config draft model {draft_name!r} cannot propose tokens for this model: "
                     f"{problem}; a draft model needs the model's tokenizer (the same vocabulary)")


class DraftModelSpeculator:
    """The scheduler's DraftSource for the "draft_model" method (see the module docstring).

    Args:
        config: the engine's SpeculativeConfig.
        forward: the draft model's forward over DraftChunks (its KV cache is the one `block_manager` maps).
        block_manager: the draft's own KV block pool (no prefix caching).
        max_model_len: no proposal reaches past it.
        max_num_tokens: the most tokens of one draft forward (its buffers).
        adapters: the per-request draft adapters whose slots `forward` reads (None: the draft runs
            without adapters, and a request naming one runs without it).
    """

    def __init__(self, config: SpeculativeConfig, forward: DraftForward, block_manager: BlockManager, *,
                 max_model_len: int, max_num_tokens: int, adapters: DraftAdapters | None = None) -> None:
        self.config = config
        self.adapters = adapters
        self.forward = forward
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self._states: dict[str, _DraftState] = {}
        self._proposals: dict[str, list[int]] = {}  # this step's, by request id
        self.num_forwards = 0  # draft forward passes run (cumulative, for tests and benchmarks)
        self.num_computed_tokens = 0  # tokens those computed

    @property
    def num_speculative_tokens(self) -> int:
        """k."""
        return self.config.num_speculative_tokens

    def state(self, request: Request) -> str:
        """Whether the request's draft adapter lets it run: "ready" (or none), "loading" or "failed"
        (request.error set); DraftAdapters.state. Always "ready" without draft adapters."""
        return "ready" if self.adapters is None else self.adapters.state(request)

    def prepare(self, running: list[Request]) -> None:
        """This step's proposals for the running requests (see the module docstring)."""
        self._proposals = {}
        try:
            proposing = self._catch_up(running)
            for _ in range(1, self.num_speculative_tokens):
                proposing = [p for p in proposing if len(p.tokens) < p.limit]
                if not proposing:
                    break
                self._feed_back(proposing)
        except Exception as error:  # the draft failed: this step goes without proposals, and it starts over
            logger.warning("the draft model's forward failed (%r): no proposals this step", error)
            for request_id in list(self._states):
                self._drop(request_id)
            self._proposals = {}

    def _catch_up(self, running: list[Request]) -> list[_Proposing]:
        """Rollback, then the step's first forward: every request's catch-up and the proposing ones'
        last token (see the module docstring). Returns the proposing requests with their first proposal."""
        k = self.num_speculative_tokens
        limits = {request: draft_limit(request, k, self.max_model_len) if request.num_uncomputed_tokens == 1 else 0
                  for request in running}
        order = sorted(limits, key=lambda r: limits[r] == 0)  # stable: proposing ones first, oldest first
        slots = (dict.fromkeys(order, -1) if self.adapters is None
                 else self.adapters.slots([r for r in order if limits[r] or self._behind(r)]))
        budget = self.max_num_tokens
        chunks: list[DraftChunk] = []
        proposing: list[_Proposing] = []
        for request in order:
            if request not in slots:  # its draft adapter got no slot this step: it catches up later
                continue
            nv = request.num_virtual_tokens
            real = request.token_ids if nv == 0 else request.token_ids[nv:]  # [L]
            state = self._states.setdefault(request.request_id, _DraftState())
            _rollback(state, real)
            limit = limits[request]
            if limit and len(state.cached) == len(real):  # its last token's logits are needed: computed again
                del state.cached[-1]
                state.confirmed = len(state.cached)
            goal = len(real) if limit else request.num_computed_tokens - nv  # the target's computed tokens
            start = len(state.cached)
            num_new = min(goal - start, budget)
            if num_new <= 0:
                continue
            samples = limit > 0 and start + num_new == len(real)
            written = start + num_new + (limit - 1 if samples else 0)  # its proposals but the last are fed back
            if not self.block_manager.can_allocate(request.request_id, written):
                logger.debug("draft KV pool full: request %r gets no proposals this step", request.request_id)
                continue
            self.block_manager.allocate(request.request_id, written)
            chunks.append(DraftChunk(real, start, num_new, self.block_manager.table(request.request_id), samples,
                                     slots[request]))
            state.cached.extend(real[start:start + num_new])
            state.confirmed = len(state.cached)
            if samples:
                proposing.append(_Proposing(request.request_id, state, limit, slots[request]))
            budget -= num_new
            if budget == 0:
                break
        if chunks:
            self._run(chunks, proposing)
        return proposing

    def _feed_back(self, proposing: list[_Proposing]) -> None:
        """One more forward: each proposing request feeds its latest proposal, and proposes the argmax after it."""
        chunks = []
        for p in proposing:
            p.state.cached.append(p.tokens[-1])
            chunks.append(DraftChunk(p.state.cached, len(p.state.cached) - 1, 1,
                                     self.block_manager.table(p.request_id), True, p.lora_slot))
        self._run(chunks, proposing)

    def _run(self, chunks: list[DraftChunk], proposing: list[_Proposing]) -> None:
        tokens = self.forward(chunks)
        assert len(tokens) == len(proposing), f"{len(tokens)} draft tokens for {len(proposing)} proposing rows"
        self.num_forwards += 1
        self.num_computed_tokens += sum(c.num_new_tokens for c in chunks)
        for p, token in zip(proposing, tokens):
            p.tokens.append(token)
            self._proposals[p.request_id] = p.tokens

    def drafts(self, request: Request, budget: int) -> list[int]:
        """This step's proposals for a decoding request, within `budget` tokens of the step (its last
        token included); [] when it proposed none."""
        return self._proposals.get(request.request_id, [])[:max(0, budget - 1)]

    def _behind(self, request: Request) -> bool:
        """True unless the draft's cache holds every token the target computed of a request (tokens known to
        agree: its rollback keeps at least those), so a non-proposing request that is not behind runs nothing."""
        state = self._states.get(request.request_id)
        return state is None or state.confirmed < request.num_computed_tokens - request.num_virtual_tokens

    def release(self, request: Request) -> None:
        """The request finished or was preempted: its draft KV blocks go back to the pool; a finished one
        lets its draft adapter go too (a preempted one keeps it: it runs again)."""
        self._drop(request.request_id)
        if request.is_finished and self.adapters is not None:
            self.adapters.release(request)

    def close(self) -> None:
        """The engine closed: the draft adapters' background loads stop (DraftAdapters.close)."""
        if self.adapters is not None:
            self.adapters.close()

    def _drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._proposals.pop(request_id, None)
        self.block_manager.free(request_id)


def _rollback(state: _DraftState, real: Sequence[int]) -> None:
    """Cut the cached tokens back to the longest prefix that agrees with the request's tokens `real`:
    the K/V of position p depends on tokens 0..p alone, so those stay valid and nothing after them is."""
    cached = state.cached
    end = min(len(cached), len(real))
    agree = state.confirmed  # tokens only ever get appended: the confirmed ones still agree
    while agree < end and cached[agree] == real[agree]:
        agree += 1
    del cached[agree:]
    state.confirmed = agree
