"""The engine's intake: requests and aborts handed from any thread to the one thread that steps.

``add_request`` reserves a request's ids (``adding``), acquires its adapters outside any lock, then
queues its samples; ``abort_request`` queues the live request objects it names; each step starts
with ``take()``, which moves both into the scheduler's hands. The intake also keeps the n > 1
sample groups (lora_runner.engine.parallel_sampling) from add to their merged finished output, and
the idle accounting behind ``wait_for_work``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from lora_runner.core.request import Request
from lora_runner.engine.errors import EngineClosedError
from lora_runner.engine.parallel_sampling import SampleGroup, merge_outputs
from lora_runner.outputs import RequestOutput


class Intake:
    """Thread-safe intake of one LLMEngine.

    Thread-safety contract: every method may be called from any thread; all state sits behind one
    condition lock, held only for short bookkeeping (never while adapters load or a model runs).
    ``take``, ``merge_samples``, ``step_began`` and ``step_ended`` are meant for the one thread
    inside ``LLMEngine.step``; ``wait_for_work`` blocks its caller until ``wake`` is called
    (by an add, an abort, a finished adapter load or ``close``) after a step that found nothing.

    A request id is in use from ``adding`` until ``finished`` is told about that very request
    object: an abort holds the object, not the id, so it never reaches a later request that reuses
    the id.
    """

    def __init__(self) -> None:
        self._work = threading.Condition()  # its lock guards everything below
        self._new: list[Request] = []
        self._aborts: list[Request] = []  # the request objects, so an id reused later is never hit
        self._live: dict[str, Request] = {}  # id -> request queued and not yet reported finished
        self._adding: set[str] = set()  # ids inside add_request: taken, but invisible to abort
        self._groups: dict[str, SampleGroup] = {}  # caller id -> its samples, for requests with n > 1
        self._sample_of: dict[str, tuple[SampleGroup, int]] = {}  # sample id -> (group, index)
        self._closed = False
        self._events = 0  # wake() calls so far
        self._idle_since: int | None = None  # _events as the last step began, when it found nothing

    # ----------------------------------------------------------------------------- any thread
    def check_open(self) -> None:
        """EngineClosedError once ``close()`` was called."""
        if self._closed:
            raise EngineClosedError("the engine is closed: create a new LLMEngine to serve more requests")

    def close(self) -> None:
        """Refuse new requests from now on (``adding`` raises EngineClosedError) and wake waiters."""
        with self._work:
            self._closed = True
        self.wake()

    @contextmanager
    def adding(self, request_id: str, samples: list[Request]) -> Iterator[None]:
        """Reserve the ids of one caller request, run the body (acquiring its adapters), then queue it.

        ``samples`` are its sample requests: one whose id is ``request_id``, or n with their own ids.
        Raises EngineClosedError when closed, ValueError when any id is in use, before the body
        runs. If the body raises, the ids are free again and nothing is queued; else the samples
        become live (abortable, counted as unfinished) and queued for the next ``take()``.
        """
        taken = {request_id, *(r.request_id for r in samples)}
        with self._work:
            self.check_open()
            if any(self._is_taken(i) for i in taken):
                sample_ids = [r.request_id for r in samples]
                raise ValueError(f"request id {request_id!r} is already in use"
                                 + (f" (or one of its sample ids {sample_ids})" if len(samples) > 1 else ""))
            self._adding |= taken
        try:
            yield
        except BaseException:
            with self._work:
                self._adding -= taken
            raise
        with self._work:  # visible to abort only now, with its adapters held: reported finished once
            self._adding -= taken
            if len(samples) > 1:
                group = self._groups[request_id] = SampleGroup(request_id, samples)
                self._sample_of.update((r.request_id, (group, i)) for i, r in enumerate(samples))
            for request in samples:
                self._live[request.request_id] = request
            self._new.extend(samples)
        self.wake()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Queue the live requests named (a group's id names all its samples; unknown ids are ignored)."""
        with self._work:  # only requests live now: never one added later under the same id
            ids = [sample for i in request_ids for sample in self._sample_ids(i)]
            self._aborts.extend(self._live[i] for i in ids if i in self._live)
        self.wake()

    def finished(self, request: Request) -> None:
        """`request` was reported finished: its id is free again (a stale object frees nothing)."""
        with self._work:
            if self._live.get(request.request_id) is request:
                del self._live[request.request_id]

    def has_unfinished(self) -> bool:
        """True while any queued request has not been reported finished."""
        with self._work:
            return bool(self._live)

    def live(self, request_id: str) -> Request | None:
        """The live request with this (sample) id, if any."""
        with self._work:
            return self._live.get(request_id)

    def in_use(self, request_id: str) -> bool:
        """True while `request_id` is reserved, live, or the id of an unfinished sample group."""
        with self._work:
            return self._is_taken(request_id)

    def wake(self) -> None:
        """Something a step could act on happened: wake ``wait_for_work``."""
        with self._work:
            self._events += 1
            self._work.notify_all()

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a step could make progress: returns True at once unless the last step found
        nothing to run; then waits for a ``wake`` since that step began. False on timeout."""
        with self._work:
            seen = self._idle_since
            if seen is None:
                return True
            return self._work.wait_for(lambda: self._events != seen, timeout)

    # ----------------------------------------------------------------------------- the stepping thread
    def take(self) -> tuple[list[tuple[Request, Request | None]], list[Request]]:
        """Everything queued since the last take: ([(new request, its group's leader or None)], aborts).

        An abort may name a request that finished since it was asked for: the caller checks."""
        with self._work:
            new, aborts = self._new, self._aborts
            self._new, self._aborts = [], []
            return [(r, self._leader_of(r)) for r in new], aborts

    def merge_samples(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One RequestOutput per request with n > 1 (parallel_sampling.merge_outputs); a finished
        group is forgotten, so its id is free again."""
        with self._work:
            if not self._groups:
                return outputs
            merged = merge_outputs(outputs, self._sample_of)
            for output in merged:
                if output.finished and output.request_id in self._groups:
                    group = self._groups.pop(output.request_id)
                    for request in group.samples:
                        self._sample_of.pop(request.request_id, None)
        return merged

    def step_began(self) -> int:
        """The number of wakes so far, as a step begins; give it to ``step_ended``."""
        with self._work:
            return self._events

    def step_ended(self, idle_since: int | None) -> None:
        """``step_began()``'s count when the step found nothing to run, None when it ran something:
        ``wait_for_work`` then sleeps until a wake that came after that step began."""
        with self._work:
            self._idle_since = idle_since

    def _is_taken(self, request_id: str) -> bool:
        return request_id in self._live or request_id in self._adding or request_id in self._groups

    def _sample_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return [request_id] if group is None else [r.request_id for r in group.samples]

    def _leader_of(self, request: Request) -> Request | None:
        entry = self._sample_of.get(request.request_id)
        return entry[0].leader_of(request) if entry is not None else None
