"""Continuous batching with chunked prefill, preemption by recompute and adapter-aware, fair admission.

Each step the scheduler gives every running request (oldest first) the tokens it still has to
compute, a decode token or the next prefill chunk, within `max_num_batched_tokens`. When the KV
cache runs out of blocks the newest running request is preempted: it frees its blocks and goes
back to the front of the waiting queue to recompute its tokens later. Then, if nothing was
preempted, waiting requests are admitted while there is budget, a free sequence slot, enough
blocks and room for their LoRA among at most `max_loras` distinct adapters and for their prompt
adapter among at most `max_prompt_adapters` (a soft prompt needs its slot only until its virtual
tokens are computed). The order is the policy's: "fcfs" takes them in arrival order, "fair" takes
the next request of the least-served tenant (lora_runner.core.fairness). A waiting request whose adapter
is still loading, whose placeholders are not inserted yet, or whose structured-output grammar still
compiles (``grammar_state``), is skipped (others behind it may run); one whose adapter or grammar
failed, or that the engine marked with an error, is handed back in `failed`.

Slot handover ("fair"): when a ready request finds no adapter slot, one held adapter is chosen to
give its slot up (unpinned, its tenants the most served); requests behind the starved one in line may
not join that adapter, so the slot frees as its running requests finish and the starved request
gets it. The choice is kept across steps, so the drained adapter does not flip back and forth.

Prefix caching (BlockManager with enable_caching): an admitted request starts with the longest
cached chain of its full blocks (keyed by its tokens, LoRA version, prompt-adapter version and cache
salt: lora_runner.core.prefix_cache) and computes only the rest, preempted requests included;
postprocess registers every block that filled up. A request that asks for prompt logprobs starts with
no cached prefix, so every prompt position is computed (its blocks are registered all the same). A
parallel sample shares its leader's prompt blocks (fork) as before.

Speculative decoding (a ``speculator``, lora_runner.spec_decode): a running request that decodes
(one uncomputed token, so never a prefill chunk) is scheduled with the draft tokens the speculator
proposes after its last token, within the budget and only when the KV blocks for them are free
(speculation never preempts). postprocess rolls the computed count back by the drafts the step
rejected before it registers blocks, so the prefix cache holds only accepted tokens and the
rejected drafts' KV slots are written again later. A step in which more requests decode than the
speculator's ``disable_by_batch_size`` proposes no drafts. Verify steps are counted in the scheduler's
``spec`` (all requests), ``spec_by_adapter`` (per adapter name, None for the base model) and each
request's own ``spec``. The speculator sees the running
requests once per step before any proposal, in steps that may verify drafts (``prepare``: a draft
model runs its batched forwards there), and hears of each request that leaves them, finished or
preempted (``release``: a draft model frees its own KV blocks).
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

from adapters.errors import AdapterCapacityError
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.fairness import POLICIES, FairQueue, FcfsQueue, VirtualTokenCounter, served_tokens, tenant_of
from lora_runner.core.request import Request, RequestStatus
from lora_runner.core.scheduler_output import Placement, ScheduledRequest, SchedulerOutput
from lora_runner.core.step_result import OutputSink, SampledRows
from lora_runner.outputs import SpecDecodingStats

logger = logging.getLogger(__name__)


# adapter ref -> "ready" | "loading" | "failed"
AdapterState = Callable[[Hashable], str]
# adapter refs of a step -> device slots that other (pinned) adapters keep meanwhile
ReservedSlots = Callable[[set], int]
# request -> its structured-output grammar's "ready" | "loading" | "failed" (failed: request.error set)
GrammarState = Callable[[Request], str]
# the step's picked requests -> their adapters made resident (lora_runner.engine.adapters' place)
Place = Callable[[list[ScheduledRequest]], Placement]


class DraftSource(Protocol):
    """Where a speculating scheduler gets draft tokens (lora_runner.spec_decode.adaptive.SpeculationPolicy,
    around ngram.Speculator or draft_model.DraftModelSpeculator)."""

    num_speculative_tokens: int  # k: the most drafts per request and step
    disable_by_batch_size: int | None  # no drafts in a step where more requests decode; None: no limit

    def prepare(self, running: list[Request]) -> None:
        """Once per step before any drafts(): the running requests, oldest first (a draft model runs
        its forwards for all of them here, batched)."""

    def release(self, request: Request) -> None:
        """`request` left the running set (finished, aborted or preempted): what is held for it goes."""

    def state(self, request: Request) -> str:
        """A waiting request's draft adapter: "ready" (or none), "loading" (it waits, as for its own adapter)
        or "failed" (request.error set: it fails)."""

    def drafts(self, request: Request, budget: int) -> list[int]:
        """Draft tokens after a decoding request's last token, within `budget` tokens (that one included)."""

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `request` accepted the first `num_accepted` of its `num_drafts` drafts."""


def _adapter_name(request: Request) -> str | None:
    """The name of the adapter a request runs with (its LoRA, else its soft prompt), None for the base model."""
    adapter = request.lora_request or request.prompt_adapter_request
    return None if adapter is None else adapter.name


def _no_grammar(request: Request) -> str:
    return "ready"


@dataclass(frozen=True)
class _Picked:
    """A request schedule() picked, before placement decides whether it joins the step."""

    scheduled: ScheduledRequest
    block_ids: list[int]  # a running request: the blocks its table gained; an admitted one: its whole table
    new: bool  # admitted this step (sent in full), else running before (sent as a diff)


@dataclass(frozen=True)
class AdapterSlots:
    """One adapter kind as admission sees it: at most `max_slots` distinct refs per step."""

    kind: str  # "LoRA" or "prompt adapter", for messages
    limit: str  # the setting that sizes the slots, for messages
    max_slots: int
    state: AdapterState
    reserved: ReservedSlots
    ref_of: Callable[[Request], Hashable | None]  # the ref whose slot a request needs now, or None


def _lora_ref(request: Request) -> Hashable | None:
    return request.lora_ref


def _prompt_adapter_ref(request: Request) -> Hashable | None:
    return request.prompt_adapter_ref if request.needs_prompt_adapter else None


class Scheduler:
    """Decides which requests run each step (see the module docstring for the policy)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int, adapter_state: AdapterState,
                 reserved_lora_slots: ReservedSlots = lambda refs: 0, max_prompt_adapters: int = 0,
                 prompt_adapter_state: AdapterState | None = None,
                 reserved_prompt_slots: ReservedSlots = lambda refs: 0,
                 policy: str = "fair", fairness: VirtualTokenCounter | None = None,
                 grammar_state: GrammarState = _no_grammar, speculator: DraftSource | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.adapter_state = adapter_state
        self.reserved_lora_slots = reserved_lora_slots
        self.max_prompt_adapters = max_prompt_adapters
        self.prompt_adapter_state = prompt_adapter_state
        self.reserved_prompt_slots = reserved_prompt_slots
        self.grammar_state = grammar_state
        self.speculator = speculator
        self.spec = SpecDecodingStats(speculator.num_speculative_tokens if speculator is not None else 0)
        self.spec_by_adapter: dict[str | None, SpecDecodingStats] = {}  # adapter name (None: base) -> its counts
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: oldest first
        self.num_preemptions = 0  # cumulative, for stats and tests
        self.prefix_query_tokens = 0  # tokens of admitted requests looked up in the prefix cache (cumulative)
        self.prefix_hit_tokens = 0  # of those, tokens admission found computed (cached or shared)
        self.policy = policy
        self.fairness = fairness if fairness is not None else VirtualTokenCounter()  # kept under "fcfs" too
        self._tenants: dict[Request, str] = {}  # unfinished request -> the tenant it joined as
        self._handover: dict[str, Hashable] = {}  # adapter kind -> held ref that gives its slot to a starved one
        self._leaders: dict[Request, Request] = {}  # parallel sample -> sample 0 of its prompt (see add)
        self._finished_ids: list[str] = []  # ids removed since the previous output (the runner frees their rows)

    def add(self, request: Request, leader: Request | None = None) -> None:
        """Queue a new request at the back of the waiting queue.

        leader: for parallel sample i > 0 of one prompt, sample 0 (added first). The sample then
        waits until the leader has computed its prompt, and starts by sharing the leader's full
        prompt blocks (BlockManager.fork); it computes only the rest itself (less than one block
        plus the last prompt token). If the leader finished or was preempted, it computes it all.
        """
        if leader is not None:
            self._leaders[request] = leader
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        self._tenants[request] = tenant_of(request)
        self.fairness.join(self._tenants[request])

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self, place: Place | None = None) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocates their KV blocks. The output also
        carries, for the runner, what changed since the previous one (core.scheduler_output).

        place: makes the picked requests' adapters resident (the engine's adapter seam) and says which got
        no slot; those are not scheduled: they come back in ``failed`` with their error, and a running
        one's row is freed with this output (``finished_ids``). None: every request is placed, no slots."""
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        picked: list[_Picked] = []
        budget = self._schedule_running(out, picked, self.max_num_batched_tokens)
        out.failed = self._take_failed()
        if not out.preempted_ids:
            self._admit_waiting(picked, budget)
        placement = place([p.scheduled for p in picked]) if place is not None and picked else Placement()
        out.lora_slots, out.prompt_slots = placement.lora_slots, placement.prompt_slots
        for p in picked:
            error = placement.unplaced.get(p.scheduled.request)
            if error is not None:
                self._unplace(p, error, out)
            elif p.new:
                out.add_new(p.scheduled, p.block_ids)
            else:
                out.add_continuing(p.scheduled, p.block_ids)
        for s in out.scheduled:
            self.fairness.charge(self._tenants[s.request], *served_tokens(s.request, s.num_new_tokens, s.samples))
        return out

    def _unplace(self, picked: _Picked, error: BaseException, out: SchedulerOutput) -> None:
        """A picked request whose adapter got no slot leaves the step: failed with ``error`` (the engine
        finishes it, which frees its blocks); a running one's row goes with this output."""
        request = picked.scheduled.request
        request.error = error
        self.running.remove(request)
        out.failed.append(request)
        if not picked.new:
            out.finished_ids.append(request.request_id)

    def _schedule_running(self, out: SchedulerOutput, picked: list[_Picked], budget: int) -> int:
        speculates = self._speculates_this_step()
        if speculates:
            self.speculator.prepare(self.running)
        pending = deque(self.running)  # oldest first; victims are taken from the back
        kept: list[Request] = []
        while pending:
            request = pending.popleft()
            if budget == 0:
                kept.append(request)
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            end = request.num_computed_tokens + num_new
            drafts = self._drafts(request, budget) if speculates else []
            if drafts and self.block_manager.can_allocate(request.request_id, end + len(drafts)):
                end += len(drafts)
            else:
                drafts = []  # speculation never preempts: without room its request decodes one token
            new_block_ids: list[int] = []
            if self.block_manager.blocks_needed(request.request_id, end):  # most decode steps need none
                while not self.block_manager.can_allocate(request.request_id, end) and pending:
                    self._preempt(pending.pop(), out)
                if not self.block_manager.can_allocate(request.request_id, end):
                    self._preempt(request, out)
                    continue
                new_block_ids = self.block_manager.allocate(request.request_id, end)
            picked.append(_Picked(ScheduledRequest(request, request.num_computed_tokens, num_new + len(drafts),
                                                   tuple(drafts)), new_block_ids, new=False))
            kept.append(request)
            budget -= num_new + len(drafts)
        self.running = kept
        return budget

    def _speculates_this_step(self) -> bool:
        """True when the step may verify drafts: speculation is on and no more running requests decode
        than the speculator's disable_by_batch_size."""
        if self.speculator is None:
            return False
        limit = self.speculator.disable_by_batch_size
        return limit is None or sum(r.num_uncomputed_tokens == 1 for r in self.running) <= limit

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The draft tokens a running request verifies this step: [] unless it decodes and speculates."""
        if self.speculator is None or request.num_uncomputed_tokens != 1:
            return []
        return self.speculator.drafts(request, budget)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.block_manager.free(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request)
        request.preempt()
        self.waiting.appendleft(request)
        out.preempted_ids.append(request.request_id)
        self.num_preemptions += 1
        logger.info("preempted request %r (KV cache full); it will recompute %d tokens",
                    request.request_id, request.num_tokens)

    def _adapter_slots(self) -> list[AdapterSlots]:
        # built per call: tests and tools may swap adapter_state on a live scheduler
        kinds = [AdapterSlots("LoRA", "max_loras", self.max_loras, self.adapter_state, self.reserved_lora_slots,
                              _lora_ref)]
        if self.prompt_adapter_state is not None:
            kinds.append(AdapterSlots("prompt adapter", "max_prompt_adapters", self.max_prompt_adapters,
                                      self.prompt_adapter_state, self.reserved_prompt_slots, _prompt_adapter_ref))
        return kinds

    def _take_failed(self) -> list[Request]:
        failed = [request for request in self.waiting if request.error is not None or self._adapter_failed(request)
                  or self.grammar_state(request) == "failed"
                  or self.speculator is not None and self.speculator.state(request) == "failed"]
        for request in failed:
            self.waiting.remove(request)
        return failed

    def _adapter_failed(self, request: Request) -> bool:
        """True when an adapter of the request failed to load or can never get a slot (sets request.error)."""
        for kind in self._adapter_slots():
            ref = kind.ref_of(request)
            if ref is None:
                continue
            if kind.state(ref) == "failed":
                return True
            if kind.reserved({ref}) >= kind.max_slots:
                request.error = AdapterCapacityError(
                    f"{kind.kind} {getattr(ref, 'name', ref)!r} can never get a device slot: pinned adapters hold "
                    f"all {kind.max_slots}; unpin one or raise {kind.limit}")
                return True
        return False

    @staticmethod
    def _fits(kind: AdapterSlots, ref: Hashable, held: set) -> bool:
        if ref in held:
            return True
        wanted = held | {ref}
        return len(wanted) + kind.reserved(wanted) <= kind.max_slots

    def _admit_waiting(self, picked: list[_Picked], budget: int) -> None:
        if not self.waiting:  # nothing to admit: skip the sets over the running requests below
            if budget > 0 and len(self.running) < self.max_num_seqs:
                self._handover = {}  # what the loop concludes when its queue is empty
            return
        kinds = self._adapter_slots()
        held = [{k.ref_of(r) for r in self.running} - {None} for k in kinds]  # per kind: refs with a slot
        queue = FairQueue(self.waiting, self.fairness) if self.policy == "fair" else FcfsQueue(self.waiting)
        starved: set[str] = set()  # kinds in which a ready request ahead in line found no slot
        admitted: set[Request] = set()
        while budget > 0 and len(self.running) < self.max_num_seqs:
            request = queue.pop()
            if request is None:
                self._handover = {kind: ref for kind, ref in self._handover.items() if kind in starved}
                break
            refs = [k.ref_of(request) for k in kinds]
            if not self._may_admit(request, kinds, refs, held, starved):
                continue  # still loading, no slot for one of its adapters, or its slot is handed over
            self._share_leader_prompt(request)
            # a forked sample starts past 0 already; anyone else starts past its cached prefix, if any
            # ... unless it asks for prompt logprobs: then every prompt position runs (its blocks still register)
            prefix = ([] if request.num_computed_tokens or request.wants_prompt_logprobs
                      else self.block_manager.cached_prefix(request))
            start = request.num_computed_tokens + len(prefix) * self.block_manager.block_size
            num_new = min(request.num_tokens - start, budget)
            if not self.block_manager.can_allocate(request.request_id, start + num_new, prefix):
                break  # in line order: do not let later requests jump the KV queue
            self.block_manager.allocate(request.request_id, start + num_new, prefix)
            request.num_computed_tokens = start
            self._count_prefix_hit(request, start)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            picked.append(_Picked(ScheduledRequest(request, start, num_new),
                                  list(self.block_manager.table(request.request_id)), new=True))
            queue.charge(request, *served_tokens(request, num_new, num_new == request.num_uncomputed_tokens))
            admitted.add(request)
            budget -= num_new
            for ref, h in zip(refs, held):
                if ref is not None:
                    h.add(ref)
        if admitted:
            self.waiting = deque(r for r in self.waiting if r not in admitted)

    def _count_prefix_hit(self, request: Request, start: int) -> None:
        """Count a prefix-cache lookup of an admitted request, whose tokens before `start` are computed
        already (cached or forked); its first admission sets num_cached_tokens (prompt tokens only)."""
        if not self.block_manager.enable_caching:
            return
        self.prefix_query_tokens += request.num_tokens
        self.prefix_hit_tokens += start
        if request.num_preemptions == 0:
            request.num_cached_tokens = max(0, start - request.num_virtual_tokens)

    def _prompt_blocks_to_share(self, request: Request) -> int | None:
        """Full blocks of the leader's computed prompt `request` can share now; None while it should
        wait for its leader's prefill; 0 when there is nothing to share (no leader, or it is gone)."""
        leader = self._leaders.get(request)
        if leader is None or leader.is_finished or request.num_computed_tokens or \
                self.block_manager.table(request.request_id):
            return 0
        prompt_len = leader.num_virtual_tokens + leader.num_prompt_tokens  # the tokens both have in common
        if leader not in self.running or leader.num_computed_tokens < prompt_len:
            return None
        # at least the last prompt token stays to compute: the sample needs its own logits to sample from
        return min(leader.num_computed_tokens, request.num_tokens - 1, prompt_len - 1) // self.block_manager.block_size

    def _share_leader_prompt(self, request: Request) -> None:
        num_blocks = self._prompt_blocks_to_share(request)
        if num_blocks:
            self.block_manager.fork(self._leaders[request].request_id, request.request_id, num_blocks)
            request.num_computed_tokens = num_blocks * self.block_manager.block_size

    def _may_admit(self, request: Request, kinds: list[AdapterSlots], refs: list, held: list[set],
                   starved: set[str]) -> bool:
        """True when the request can join this step; under "fair", a ready request without a slot
        marks its kind starved and picks the held ref whose slot it will get (see the module docstring).
        A parallel sample waits for its leader's prefill (see add)."""
        if self._prompt_blocks_to_share(request) is None:
            return False
        if self.grammar_state(request) != "ready":  # its structured-output grammar still compiles
            return False
        if self.speculator is not None and self.speculator.state(request) != "ready":  # its draft adapter loads
            return False
        if request.awaiting_virtual_tokens or any(
                ref is not None and k.state(ref) != "ready" for k, ref in zip(kinds, refs)):
            return False
        for k, ref, h in zip(kinds, refs, held):
            if ref is None:
                continue
            if k.kind in starved and ref == self._handover.get(k.kind):
                return False  # its slot goes to a request ahead in line once the running ones finish
            if not self._fits(k, ref, h):
                if self.policy == "fair":
                    starved.add(k.kind)
                    if self._handover.get(k.kind) not in h and h:
                        self._handover[k.kind] = self._pick_handover(k, h)
                return False
        return True

    def _pick_handover(self, kind: AdapterSlots, held: set) -> Hashable:
        """The held ref whose slot goes to a starved request: unpinned first (a pinned one keeps its
        slot anyway), then the one whose tenants were served most (VTC: the most-served gives way),
        then the fewest running requests (frees soonest), then the most recently admitted."""
        served: dict[Hashable, float] = {}
        num_running: dict[Hashable, int] = {}
        newest: dict[Hashable, int] = {}
        for request in self.running:  # oldest first
            ref = kind.ref_of(request)
            if ref in held:
                counter = self.fairness.counter(self._tenants[request])
                served[ref] = max(served.get(ref, counter), counter)
                num_running[ref] = num_running.get(ref, 0) + 1
                newest[ref] = request.arrival
        reserved = kind.reserved(set())
        return min(held, key=lambda ref: (kind.reserved({ref}) < reserved, -served.get(ref, 0.0),
                                          num_running.get(ref, 0), -newest.get(ref, 0)))

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (it finished or was aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request)
        self._finished_ids.append(request.request_id)
        self._leaders.pop(request, None)
        if request in self._tenants:
            self.fairness.leave(self._tenants.pop(request))

    def _count_drafts(self, scheduled: ScheduledRequest, tokens: list[int]) -> int:
        """Count a sampled chunk's drafts in the request's and the scheduler's counters; returns how many
        were rejected. A row of a + 1 tokens accepted a drafts (a failed row, no tokens: none), as
        InputBatch.commit counts them."""
        num_drafts = len(scheduled.draft_token_ids)
        if not num_drafts:
            return 0
        accepted = max(len(tokens) - 1, 0)
        if not scheduled.request.spec.num_speculative_tokens:  # its first verify step: sized as the scheduler's
            scheduled.request.spec = SpecDecodingStats(self.spec.num_speculative_tokens)
        scheduled.request.spec.add(num_drafts, accepted)
        self.spec.add(num_drafts, accepted)
        adapter = _adapter_name(scheduled.request)
        if adapter not in self.spec_by_adapter:
            self.spec_by_adapter[adapter] = SpecDecodingStats(self.spec.num_speculative_tokens)
        self.spec_by_adapter[adapter].add(num_drafts, accepted)
        self.speculator.observe(scheduled.request, num_drafts, accepted)
        return num_drafts - accepted

    def postprocess(self, scheduled: list[ScheduledRequest], sampled: SampledRows,
                    processor: OutputSink) -> list[tuple[Request, BaseException | None]]:
        """After the model ran: count each scheduled chunk as computed (less the draft tokens its row
        rejected: a row of a + 1 tokens accepted a of its drafts), append every sampled token
        (processor.append: detokenize, check stops, each token of a row in order) and finish and
        remove (free the blocks of) the requests that stopped. sampled: one row per chunk with
        samples=True, in order, holding that row's tokens (one from the Sampler); a request that
        stops on one of its row's tokens drops the tokens after it.

        Returns (request, error) per sampled request. error: the sampler's error for its row, or what
        appending its tokens raised; that request alone failed and is left for the caller to finish
        with "error" (it releases adapters too); the others go on.
        """
        chunks = [s for s in scheduled if s.samples]
        assert len(chunks) == len(sampled.sampled_token_ids), \
            f"{len(sampled.sampled_token_ids)} sampled rows for {len(chunks)} sampling requests"
        rows = iter(sampled.sampled_token_ids)
        for s in scheduled:
            rejected = self._count_drafts(s, next(rows)) if s.samples else 0
            s.request.num_computed_tokens += s.num_new_tokens - rejected
            if not s.draft_token_ids:  # a speculating one's accepted drafts are keyed once appended, below
                self.block_manager.cache_computed(s.request)  # its blocks that filled up now answer hits
        if sampled.prompt_logprobs:  # the chunks' prompt positions, sampled or not
            by_id = {s.request.request_id: s.request for s in scheduled}
            for request_id, chunk in sampled.prompt_logprobs.items():
                processor.append_prompt_logprobs(by_id[request_id], chunk)
        results = []
        for chunk, tokens, logprobs, error in zip(chunks, sampled.sampled_token_ids, sampled.sampled_logprobs,
                                                  sampled.errors):
            request = chunk.request
            if error is None:
                try:
                    reason = processor.append(request, tokens, logprobs)
                    # the accepted drafts are its tokens now (unless a stop dropped some): their blocks register
                    if chunk.draft_token_ids and request.num_computed_tokens <= request.num_tokens:
                        self.block_manager.cache_computed(request)
                    if reason is not None:
                        request.finish(processor.finish(request, reason))
                        self.remove(request)
                except Exception as exc:  # this request's output could not be made; it alone fails
                    error = exc
            results.append((request, error))
        return results
