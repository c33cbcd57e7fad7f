"""Fair admission across tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving
Large Language Models", OSDI 2024).

Each tenant has a counter that grows by the service it gets: `prefill_weight` per prompt token
computed and `decode_weight` per token generated (tokens recomputed after a preemption count as
prefill). Admission takes waiting requests from the backlogged tenant with the smallest counter
first (`FairQueue`). A tenant that goes from idle to active has its counter lifted to the smallest
counter among active tenants (or, when none is active, to the counter of the last one that went
idle), so idleness earns no credit. Work conservation and slot handover are the scheduler's part.

A request's tenant is its `tenant` id when given, else its LoRA name, else its prompt adapter's
name, else "" (the base model).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the config (and `serve --help`) read this module without torch
    from lora_runner.core.request import Request

POLICIES = ("fair", "fcfs")
DEFAULT_PREFILL_WEIGHT = 1.0
DEFAULT_DECODE_WEIGHT = 2.0  # the paper's default: an output token costs twice an input token
_PRUNE_SLACK = 64  # idle tenants kept before pruning the ones the lift would erase anyway


def check_weight(name: str, weight) -> None:
    """ValueError unless `weight` is a finite number > 0 (a token price of the counter)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < math.inf:
        raise ValueError(f"{name} must be a finite number > 0, got {weight!r}")


def tenant_of(request: Request) -> str:
    """The tenant a request is accounted to (see the module docstring)."""
    if request.tenant is not None:
        return request.tenant
    for adapter in (request.lora_request, request.prompt_adapter_request):
        if adapter is not None:
            return adapter.name
    return ""


def served_tokens(request: Request, num_new_tokens: int, samples: bool) -> tuple[int, int]:
    """(prefill, decode) tokens a step serves a request that computes `num_new_tokens` tokens.

    A chunk that samples generates one token (decode). The token a decode step feeds in is that
    request's previous output, already counted when it was generated; every other computed token
    (the prompt, virtual tokens, outputs recomputed after a preemption) is prefill. Over a request
    that is never preempted this sums to (prompt tokens, output tokens).
    """
    fed_back = 1 if samples and request.num_output_tokens > 0 else 0
    return num_new_tokens - fed_back, 1 if samples else 0


class VirtualTokenCounter:
    """Per-tenant weighted service counters with the lift on return from idle.

    `join(tenant)` when a request of the tenant enters the scheduler, `leave(tenant)` when it
    finishes; `charge` after each step. Counters of idle tenants at or below the lift floor are
    forgotten (a return would lift them to the floor anyway), so memory follows active tenants.
    """

    def __init__(self, prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
                 decode_weight: float = DEFAULT_DECODE_WEIGHT) -> None:
        check_weight("prefill_weight", prefill_weight)
        check_weight("decode_weight", decode_weight)
        self.prefill_weight = float(prefill_weight)
        self.decode_weight = float(decode_weight)
        self._counters: dict[str, float] = {}
        self._active: dict[str, int] = {}  # tenant -> its unfinished requests
        self._last_idle = 0.0  # counter of the last tenant that went idle

    def counter(self, tenant: str) -> float:
        """The tenant's counter (the lift floor for a tenant never seen or forgotten)."""
        return self._counters.get(tenant, self._floor())

    def is_active(self, tenant: str) -> bool:
        """True while the tenant has an unfinished request."""
        return tenant in self._active

    def cost(self, num_prefill: int, num_decode: int) -> float:
        """Weighted service of `num_prefill` prefill and `num_decode` generated tokens."""
        return self.prefill_weight * num_prefill + self.decode_weight * num_decode

    def charge(self, tenant: str, num_prefill: int, num_decode: int) -> None:
        """Add served tokens to an active tenant's counter."""
        assert tenant in self._active, f"tenant {tenant!r} charged while idle"
        self._counters[tenant] += self.cost(num_prefill, num_decode)

    def join(self, tenant: str) -> None:
        """A request of `tenant` became unfinished; an idle tenant is lifted first (no idle credit)."""
        if tenant not in self._active:
            self._counters[tenant] = max(self._counters.get(tenant, 0.0), self._floor())
            self._active[tenant] = 0
        self._active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """A request of `tenant` finished (or was aborted)."""
        self._active[tenant] -= 1
        if self._active[tenant] == 0:
            del self._active[tenant]
            self._last_idle = self._counters[tenant]
            if len(self._counters) > 2 * len(self._active) + _PRUNE_SLACK:
                self._prune()

    def _floor(self) -> float:
        # never decreases: a joiner starts >= the minimum, charges only add, and the last tenant
        # to go idle was the minimum of the active set
        if self._active:
            return min(self._counters[tenant] for tenant in self._active)
        return self._last_idle

    def _prune(self) -> None:
        floor = self._floor()
        self._counters = {tenant: value for tenant, value in self._counters.items()
                          if tenant in self._active or value > floor}


class FairQueue:
    """One step's admission order: the next request of the tenant with the smallest counter.

    Within a tenant, requests keep their waiting-queue order (preempted ones first). `charge` adds
    the service a just-admitted request will get this step, so one tenant does not take every free
    seat because it was least served before the step. Ties go to the tenant whose oldest waiting
    request is nearer the front of the queue.
    """

    def __init__(self, waiting: Iterable[Request], counters: VirtualTokenCounter) -> None:
        self._counters = counters
        self._queues: dict[str, deque[Request]] = {}
        for request in waiting:
            self._queues.setdefault(tenant_of(request), deque()).append(request)
        self._rank = {tenant: rank for rank, tenant in enumerate(self._queues)}
        self._served = {tenant: counters.counter(tenant) for tenant in self._queues}
        self._heap = [(self._served[t], self._rank[t], t) for t in self._queues]
        heapq.heapify(self._heap)
        self._current: str | None = None  # tenant of the request popped last, pushed back lazily

    def pop(self) -> Request | None:
        """The next candidate, or None when every waiting request was offered."""
        tenant = self._current
        if tenant is not None and self._queues[tenant]:
            heapq.heappush(self._heap, (self._served[tenant], self._rank[tenant], tenant))
        if not self._heap:
            self._current = None
            return None
        self._current = heapq.heappop(self._heap)[2]
        return self._queues[self._current].popleft()

    def charge(self, request: Request, num_prefill: int, num_decode: int) -> None:
        """Account the service the step gives `request`, just admitted, to the order of the rest."""
        self._served[tenant_of(request)] += self._counters.cost(num_prefill, num_decode)


class FcfsQueue:
    """First come, first served: the waiting queue in order (the same interface as FairQueue)."""

    def __init__(self, waiting: Iterable[Request]) -> None:
        self._requests = iter(list(waiting))

    def pop(self) -> Request | None:
        """The next waiting request, or None."""
        return next(self._requests, None)

    def charge(self, request: Request, num_prefill: int, num_decode: int) -> None:
        """Order does not depend on service."""
