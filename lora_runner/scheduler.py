"""Continuous batching with chunked prefill, preemption by recompute and adapter-aware admission.

Each step the scheduler gives every running request (oldest first) the tokens it still has to
compute, a decode token or the next prefill chunk, within `max_num_batched_tokens`. When the KV
cache runs out of blocks the newest running request is preempted: it frees its blocks and goes
back to the front of the waiting queue to recompute its tokens later. Then, if nothing was
preempted, waiting requests are admitted in arrival order while there is budget, a free sequence
slot, enough blocks and room for their LoRA among at most `max_loras` distinct adapters and for
their prompt adapter among at most `max_prompt_adapters` (a soft prompt needs its slot only until
its virtual tokens are computed). A waiting request whose adapter is still loading, or whose
placeholders are not inserted yet, is skipped (others behind it may run); one whose adapter
failed, or that the engine marked with an error, is handed back in `failed`.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from adapters.errors import AdapterCapacityError
from lora_runner.block_manager import BlockManager
from lora_runner.sequence import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """A request's share of one step: `num_new_tokens` tokens from position `start`."""

    request: Request
    start: int  # == request.num_computed_tokens when scheduled
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token, so a new token is sampled."""
        return self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What to run this step, and what left the running set."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running first, then admitted
    failed: list[Request] = field(default_factory=list)  # adapter failed to load: finish with error
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's flat batch."""
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to run."""
        return not self.scheduled


# adapter ref -> "ready" | "loading" | "failed"
AdapterState = Callable[[Hashable], str]
# adapter refs of a step -> device slots that other (pinned) adapters keep meanwhile
ReservedSlots = Callable[[set], int]


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
                 reserved_prompt_slots: ReservedSlots = lambda refs: 0) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.adapter_state = adapter_state
        self.reserved_lora_slots = reserved_lora_slots
        self.max_prompt_adapters = max_prompt_adapters
        self.prompt_adapter_state = prompt_adapter_state
        self.reserved_prompt_slots = reserved_prompt_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: oldest first
        self.num_preemptions = 0  # cumulative, for stats and tests

    def add(self, request: Request) -> None:
        """Queue a new request at the back of the waiting queue."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocates their KV blocks."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        out.failed = self._take_failed()
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        pending = deque(self.running)  # oldest first; victims are taken from the back
        kept: list[Request] = []
        while pending:
            request = pending.popleft()
            if budget == 0:
                kept.append(request)
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            end = request.num_computed_tokens + num_new
            while not self.block_manager.can_allocate(request.request_id, end) and pending:
                self._preempt(pending.pop(), out)
            if not self.block_manager.can_allocate(request.request_id, end):
                self._preempt(request, out)
                continue
            self.block_manager.allocate(request.request_id, end)
            out.scheduled.append(ScheduledRequest(request, request.num_computed_tokens, num_new))
            kept.append(request)
            budget -= num_new
        self.running = kept
        return budget

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.block_manager.free(request.request_id)
        request.preempt()
        self.waiting.appendleft(request)
        out.preempted.append(request)
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
        failed = [request for request in self.waiting if request.error is not None or self._adapter_failed(request)]
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

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        kinds = self._adapter_slots()
        held = [{k.ref_of(r) for r in self.running} - {None} for k in kinds]  # per kind: refs with a slot
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            refs = [k.ref_of(request) for k in kinds]
            if request.awaiting_virtual_tokens or any(
                    ref is not None and (k.state(ref) != "ready" or not self._fits(k, ref, h))
                    for k, ref, h in zip(kinds, refs, held)):
                skipped.append(request)  # still loading, or no slot for one of its adapters this step
                continue
            num_new = min(request.num_uncomputed_tokens, budget)
            if not self.block_manager.can_allocate(request.request_id, num_new):
                self.waiting.appendleft(request)  # FIFO: do not let later requests jump the KV queue
                break
            self.block_manager.allocate(request.request_id, num_new)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival)
            out.scheduled.append(ScheduledRequest(request, 0, num_new))
            budget -= num_new
            for ref, h in zip(refs, held):
                if ref is not None:
                    h.add(ref)
        self.waiting.extendleft(reversed(skipped))

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (it finished or was aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)
