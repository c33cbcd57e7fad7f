"""Continuous batching with chunked prefill, preemption by recompute and adapter-aware admission.

Each step the scheduler gives every running request (oldest first) the tokens it still has to
compute, a decode token or the next prefill chunk, within `max_num_batched_tokens`. When the KV
cache runs out of blocks the newest running request is preempted: it frees its blocks and goes
back to the front of the waiting queue to recompute its tokens later. Then, if nothing was
preempted, waiting requests are admitted in arrival order while there is budget, a free sequence
slot, enough blocks and room for their LoRA among at most `max_loras` distinct adapters. A waiting
request whose adapter is still loading is skipped (others behind it may run); one whose adapter
failed is handed back in `failed`, to be finished with that error.
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


class Scheduler:
    """Decides which requests run each step (see the module docstring for the policy)."""

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_loras: int, adapter_state: AdapterState,
                 reserved_lora_slots: ReservedSlots = lambda refs: 0) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_loras = max_loras
        self.adapter_state = adapter_state
        self.reserved_lora_slots = reserved_lora_slots
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

    def _take_failed(self) -> list[Request]:
        failed = []
        for request in self.waiting:
            ref = request.lora_ref
            if ref is None:
                continue
            if self.adapter_state(ref) == "failed":
                failed.append(request)
            elif self.reserved_lora_slots({ref}) >= self.max_loras:
                request.error = AdapterCapacityError(
                    f"LoRA {getattr(ref, 'name', ref)!r} can never get a device slot: pinned adapters hold "
                    f"all {self.max_loras}; unpin one or raise max_loras")
                failed.append(request)
        for request in failed:
            self.waiting.remove(request)
        return failed

    def _lora_fits(self, ref: Hashable, loras: set) -> bool:
        if ref in loras:
            return True
        wanted = loras | {ref}
        return len(wanted) + self.reserved_lora_slots(wanted) <= self.max_loras

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        loras = {r.lora_ref for r in self.running if r.lora_ref is not None}
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            ref = request.lora_ref
            if ref is not None and (self.adapter_state(ref) != "ready" or not self._lora_fits(ref, loras)):
                skipped.append(request)  # still loading, or no LoRA slot this step
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
            if ref is not None:
                loras.add(ref)
        self.waiting.extendleft(reversed(skipped))

    def remove(self, request: Request) -> None:
        """Take a request out of the queues and free its blocks (it finished or was aborted)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request.request_id)
