"""Compilations of constraints, fair across tenants and bounded in bytes per tenant and in total.

Each tenant has its own queue of constraints waiting to compile; the compile threads take the next one
from the tenants in turn (round-robin), so a flood of distinct schemas from one tenant delays another
tenant's constraint by at most one compilation per thread. Results are cached by (tenant, constraint):
requests with the same constraint share one compilation, and nothing one tenant compiles is counted
to (or evicted for) another.

Bytes: a compiled grammar counts its own size (``size_of``: xgrammar's ``memory_size_bytes``); one still
queued or compiling counts an estimate (``reserve_of``). A tenant over its bound loses its own least
recently used compiled grammars first, then the server's least recently used go until the total fits.
A constraint that compiles to more than the tenant bound fails its requests with StructuredOutputError;
one that cannot even be reserved (the tenant's, or everyone's, in-flight compilations fill the bound)
is refused up front. The same bounds count what each live request's matcher holds (``hold``: an estimate
per matcher, Backend.matcher_bytes, until its request ends), so a tenant's many concurrent constrained
requests cannot hold matcher memory past them either.

A compilation cannot be interrupted, so one that outlives ``timeout_s`` fails its Future at the deadline
and its thread is replaced (the slot goes back); the stuck thread counts against its tenant (at most
``max_stuck_per_tenant``) and the server (``max_stuck``) until the compilation ends. Past ``max_stuck``
(constraints queued before the refusals began can still get stuck) no thread replaces it: at most
``threads + max_stuck`` threads ever run. A constraint whose
requests are all gone (``release``) before it starts is never compiled.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import count
from concurrent.futures import Future
from dataclasses import dataclass, field

from lora_runner.engine.structured.backend import StructuredOutputError, compile_timeout_error

logger = logging.getLogger(__name__)

Key = tuple[str, str]  # StructuredOutputsParams.key(): (kind, text)


@dataclass(eq=False)
class _Entry:
    """One cached (or pending) compilation of a tenant's constraint."""
    tenant: str
    key: Key
    nbytes: int  # the estimate while pending, the compiled size once done, 0 when failed
    future: Future = field(default_factory=Future)
    holders: int = 1  # requests still waiting on it (release() drops one)
    state: str = "queued"  # "queued" | "running" | "done"


class CompileQueue:
    """Runs ``compile_fn(kind, text)`` for tenants in turn, caching results bounded in bytes.

    Args:
        compile_fn: (kind, text) -> compiled object; StructuredOutputError for a constraint that fails.
        size_of: compiled object -> its size in bytes.
        reserve_of: (kind, text) -> the bytes a pending compilation counts (an estimate).
        threads: compilations that run at once.
        timeout_s: a compilation running longer fails its Future (None: no deadline).
        tenant_bytes / total_bytes: the bounds of one tenant's compiled grammars and of everyone's.
        max_stuck_per_tenant / max_stuck: compilations past their deadline still running that one tenant
            / the server may have before new constraints (of that tenant / of anyone) are refused.
        max_entries: compiled constraints kept in all (failed ones included: a repeat fails at once).
    """

    def __init__(self, compile_fn: Callable, size_of: Callable, reserve_of: Callable, *, threads: int,
                 timeout_s: float | None, tenant_bytes: int, total_bytes: int, max_stuck_per_tenant: int,
                 max_stuck: int, max_entries: int) -> None:
        self._compile_fn, self._size_of, self._reserve_of = compile_fn, size_of, reserve_of
        self._timeout_s = timeout_s
        self.tenant_bytes, self.total_bytes = tenant_bytes, total_bytes
        self.max_stuck_per_tenant, self.max_stuck, self._max_entries = max_stuck_per_tenant, max_stuck, max_entries
        self._entries: OrderedDict[tuple[str, Key], _Entry] = OrderedDict()  # least recently used first
        self._by_future: dict[Future, _Entry] = {}
        self._queues: dict[str, deque[_Entry]] = {}  # tenant -> its constraints waiting to compile
        self._served: dict[str, int] = {}  # tenant -> the turn it was last served at
        self._turns = count()
        self._bytes: dict[str, int] = {}  # tenant -> bytes of its entries
        self._held: dict[str, int] = {}  # tenant -> bytes its live requests' matchers hold (``hold``)
        self._stuck: dict[str, int] = {}  # tenant -> its compilations past their deadline, still running
        self._cond = threading.Condition()
        self._closed = False
        self._missing = 0  # compile slots of stuck threads that no new thread took (max_stuck reached)
        for _ in range(threads):
            self._start_worker()

    @property
    def num_stuck(self) -> int:
        """Compilations past their deadline whose threads still run."""
        return sum(self._stuck.values())

    def bytes_of(self, tenant: str | None = None) -> int:
        """Bytes counted to `tenant` (None: to everyone): its compiled grammars and its requests' matchers."""
        with self._cond:
            return self._used() if tenant is None else self._used(tenant)

    def hold(self, tenant: str, nbytes: int, what: str = "matcher") -> Callable[[], None]:
        """Count `nbytes` (a live request's matcher) to `tenant` until the returned (idempotent) release is
        called; the tenant's (then anyone's) least recently used compiled grammars go first to make room.
        StructuredOutputError, naming the setting, when the tenant's or the server's bound is full anyway."""
        with self._cond:
            self._evict(lambda: self._used(tenant) + nbytes > self.tenant_bytes, tenant)
            self._evict(lambda: self._used() + nbytes > self.total_bytes, None)
            if self._used(tenant) + nbytes > self.tenant_bytes:
                raise StructuredOutputError(
                    f"this tenant's constrained requests and grammars hold about {self._used(tenant)} bytes, and "
                    f"this request's {what} ({nbytes} bytes) passes the {self.tenant_bytes} a tenant may "
                    "(structured_outputs_tenant_cache_bytes); retry when some of its constrained requests finish")
            if self._used() + nbytes > self.total_bytes:
                raise StructuredOutputError(
                    f"the server's constrained requests and grammars hold about {self._used()} bytes, and this "
                    f"request's {what} ({nbytes} bytes) passes structured_outputs_cache_bytes "
                    f"({self.total_bytes}); retry later")
            self._held[tenant] = self._held.get(tenant, 0) + nbytes
        released = False

        def release() -> None:
            nonlocal released
            with self._cond:
                if not released:
                    released = True
                    self._held[tenant] -= nbytes
                    if not self._held[tenant]:
                        del self._held[tenant]

        return release

    def submit(self, key: Key, tenant: str) -> Future:
        """The Future of `tenant`'s compilation of `key` (shared with its earlier requests of the same
        key); StructuredOutputError when it is refused up front (see the module docstring)."""
        with self._cond:
            entry = self._entries.get((tenant, key))
            if entry is not None:
                self._entries.move_to_end((tenant, key))
                if entry.state != "done":
                    entry.holders += 1
                return entry.future
            self._check_stuck(tenant)
            entry = _Entry(tenant, key, self._reserve_of(*key))
            self._make_room(entry)
            self._add(entry)
            self._queues.setdefault(tenant, deque()).append(entry)
            self._cond.notify()
            return entry.future

    def release(self, future: Future) -> None:
        """One request waiting on `future` is gone; a compilation nobody waits for any more is dropped
        before it starts (its Future cancelled)."""
        with self._cond:
            entry = self._by_future.get(future)
            if entry is None or entry.state != "queued":
                return
            entry.holders -= 1
            if entry.holders > 0:
                return
            queue = self._queues[entry.tenant]
            queue.remove(entry)
            if not queue:
                del self._queues[entry.tenant]
            self._drop(entry)
        future.cancel()

    def close(self) -> None:
        """Stop the compile threads once their current compilation ends; queued ones are cancelled."""
        with self._cond:
            self._closed = True
            queued = [entry for queue in self._queues.values() for entry in queue]
            self._queues.clear()
            self._cond.notify_all()
        for entry in queued:
            entry.future.cancel()

    # ------------------------------------------------------------------ accounting (under the lock)
    def _check_stuck(self, tenant: str) -> None:
        stuck = self._stuck.get(tenant, 0)
        if stuck >= self.max_stuck_per_tenant or self.num_stuck >= self.max_stuck:
            raise StructuredOutputError(
                f"{max(stuck, self.num_stuck)} earlier constraints are still compiling past their deadline; try "
                "again later or simplify the constraint")

    def _used(self, tenant: str | None = None) -> int:
        """Bytes counted to `tenant` (None: everyone): compiled and pending grammars, and held matchers."""
        if tenant is None:
            return sum(self._bytes.values()) + sum(self._held.values())
        return self._bytes.get(tenant, 0) + self._held.get(tenant, 0)

    def _make_room(self, entry: _Entry) -> None:
        """Evict compiled grammars so that `entry` fits; StructuredOutputError when pending ones (and live
        requests' matchers) fill a bound."""
        self._evict(lambda: self._used(entry.tenant) + entry.nbytes > self.tenant_bytes, entry.tenant)
        self._evict(lambda: self._used() + entry.nbytes > self.total_bytes, None)
        if self._used(entry.tenant) + entry.nbytes > self.tenant_bytes:
            raise StructuredOutputError(
                f"this tenant's structured-output constraints still compiling take its whole grammar memory "
                f"({self.tenant_bytes} bytes, structured_outputs_tenant_cache_bytes, with its constrained requests' "
                "matchers); try again when they finish")
        if self._used() + entry.nbytes > self.total_bytes:
            raise StructuredOutputError("the server's structured-output constraints still compiling take its whole "
                                        f"grammar memory ({self.total_bytes} bytes, structured_outputs_cache_bytes, "
                                        "with the constrained requests' matchers); try again later")

    def _evict(self, over: Callable[[], bool], tenant: str | None) -> None:
        """Drop compiled entries (of `tenant`, or anyone's), least recently used first, while `over()`."""
        for entry in [e for e in self._entries.values() if e.state == "done" and tenant in (None, e.tenant)]:
            if not over():
                return
            self._drop(entry)

    def _add(self, entry: _Entry) -> None:
        self._entries[(entry.tenant, entry.key)] = entry
        self._by_future[entry.future] = entry
        self._bytes[entry.tenant] = self._bytes.get(entry.tenant, 0) + entry.nbytes
        while len(self._entries) > self._max_entries:
            oldest = next((e for e in self._entries.values() if e.state == "done"), None)
            if oldest is None:
                break
            self._drop(oldest)

    def _drop(self, entry: _Entry) -> None:
        if self._entries.get((entry.tenant, entry.key)) is entry:
            self._resize(entry, 0)
            del self._entries[(entry.tenant, entry.key)]
            self._by_future.pop(entry.future, None)

    def _resize(self, entry: _Entry, nbytes: int) -> None:
        """Set an entry's bytes (counted only while it is cached)."""
        if self._entries.get((entry.tenant, entry.key)) is entry:
            self._bytes[entry.tenant] += nbytes - entry.nbytes
            if not self._bytes[entry.tenant]:
                del self._bytes[entry.tenant]
        entry.nbytes = nbytes

    # ------------------------------------------------------------------ compile threads
    def _start_worker(self) -> None:
        threading.Thread(target=self._work, name="grammar-compile", daemon=True).start()

    def _next(self) -> _Entry | None:
        """The oldest queued entry of the tenant whose turn it is; None once closed."""
        with self._cond:
            while not self._queues and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            # the tenant served least recently (one new to the queue: before everyone)
            tenant = min(self._queues, key=lambda name: self._served.get(name, -1))
            self._served[tenant] = next(self._turns)
            queue = self._queues[tenant]
            entry = queue.popleft()
            if not queue:
                del self._queues[tenant]
            entry.state = "running"
            return entry

    def _work(self) -> None:
        while (entry := self._next()) is not None:
            if not entry.future.set_running_or_notify_cancel():
                continue
            if self._run(entry):  # it outlived its deadline: a new thread has taken this one's place
                return

    def _run(self, entry: _Entry) -> bool:
        """Compile `entry` into its Future; True when the deadline came first (this thread is stuck)."""
        overdue = threading.Event()  # set once: by the deadline, or by the end of the compilation
        timer = None
        if self._timeout_s is not None:
            timer = threading.Timer(self._timeout_s, self._overdue, (entry, overdue))
            timer.daemon = True
            timer.start()
        try:
            result, error = self._compile_fn(*entry.key), None
        except StructuredOutputError as exc:
            result, error = None, exc
        finally:
            if timer is not None:
                timer.cancel()
        with self._cond:
            if overdue.is_set():  # the deadline came first: its future failed, its slot went to a new thread
                self._stuck[entry.tenant] -= 1
                self._resize(entry, 0)
                logger.warning("a structured-output compilation (%s) ended after its deadline", entry.key[0])
                if self._missing:  # no thread replaced this one: it serves the queues again
                    self._missing -= 1
                    return False
                return True
            overdue.set()
            entry.state = "done"
            if error is None:
                error = self._account(entry, self._size_of(result))
            if error is not None:
                self._resize(entry, 0)
        if error is None:
            entry.future.set_result(result)
        else:
            entry.future.set_exception(error)
        return False

    def _account(self, entry: _Entry, nbytes: int) -> StructuredOutputError | None:
        """Count a compiled entry's real size, evicting older ones; an error when it alone is over the bound."""
        if nbytes > self.tenant_bytes:
            self._drop(entry)
            return StructuredOutputError(
                f"structured_outputs.{entry.key[0].removesuffix('_compact')} compiles to {nbytes} bytes, more than "
                f"the {self.tenant_bytes} bytes of grammar memory a tenant may use; simplify the constraint")
        if self._entries.get((entry.tenant, entry.key)) is entry:
            self._resize(entry, nbytes)
            self._entries.move_to_end((entry.tenant, entry.key))
            tenant = entry.tenant
            self._evict(lambda: self._used(tenant) > self.tenant_bytes, tenant)
            self._evict(lambda: self._used() > self.total_bytes, None)
        return None

    def _overdue(self, entry: _Entry, overdue: threading.Event) -> None:
        """The deadline of a running compilation: fail its Future and start a thread in its place."""
        with self._cond:
            if overdue.is_set():  # it ended first
                return
            overdue.set()
            self._stuck[entry.tenant] = self._stuck.get(entry.tenant, 0) + 1
            if self.num_stuck <= self.max_stuck:
                self._start_worker()
            else:  # threads stay bounded (threads + max_stuck): a stuck one that ends takes the slot back
                self._missing += 1
        logger.warning("a structured-output compilation outlived its %g s deadline; its thread is left to finish",
                       self._timeout_s)
        entry.future.set_exception(compile_timeout_error(self._timeout_s))
