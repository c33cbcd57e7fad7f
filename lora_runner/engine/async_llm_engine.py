"""AsyncLLMEngine: an LLMEngine stepped by one background thread, consumed from asyncio.

The step thread loops on ``LLMEngine.step()`` while requests are unfinished and sleeps on a
condition variable otherwise (``generate`` and ``abort`` wake it). Each step's RequestOutputs
(deltas: the engine runs every request with output_kind DELTA) go to the request's collector, which
holds at most one output, merged from every step its consumer has not read yet, and wakes the
asyncio loop of the request's ``generate`` call with ``loop.call_soon_threadsafe``. A consumer that
falls over ``max_pending_output_bytes`` behind has its request aborted. A ``generate`` iterator
that is cancelled or closed early (a client that disconnected) aborts its request, so the engine
frees its KV blocks and adapter references at the next step. ``when_finished`` tells the caller
when the engine is done with a request even though its last output is not read yet (the server
gives the request's seats back then). An exception raised by ``step()`` is
logged, delivered to every waiting iterator and leaves the engine dead: later calls raise
:class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.engine.adapter_api import AdapterAPI
from lora_runner.engine.adapters import EngineAdapters
from lora_runner.engine.errors import EngineDeadError
from lora_runner.engine.llm_engine import LLMEngine
from lora_runner.engine.stats import EngineStats
from lora_runner.outputs import RequestOutput
from lora_runner.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# While every unfinished request only waits for its adapter to load, step() makes no progress and
# returns nothing: the thread then blocks in LLMEngine.wait_for_work (woken by a finished load, a new
# request or an abort); the timeout only bounds how long a shutdown waits to be noticed.
ADAPTER_WAIT_TIMEOUT_S = 0.25
# Unread output one request may pile up (RequestOutput.approx_nbytes) before it is aborted: a consumer
# that reads keeps next to nothing pending; one that stalls (a client that stopped reading) must not
# hold its whole generation without bound. 64 MiB is ~35,000 tokens with 20 logprobs each (n=16 x 500
# tokens x 20 logprobs is ~15 MiB): a backstop, the server's send timeout acts first.
MAX_PENDING_OUTPUT_BYTES = 64 << 20


class _OutputCollector:
    """Where one request's outputs wait for its consumer: at most one, merged (vLLM v1's
    RequestOutputCollector).

    The step thread puts each step's output, a delta (the engine runs the request with output_kind
    DELTA); when the consumer has not taken the previous one yet, the new delta is folded into it,
    so a consumer that does not read holds one output, never one per step. Past `max_bytes`
    (RequestOutput.approx_nbytes) of unread output, `on_overflow` is called once (the engine aborts
    the request). The consumer's ``get`` returns the merged delta, or for a CUMULATIVE request the
    output so far, built on the consumer's side: the step thread never copies a whole output.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, cumulative: bool, max_bytes: int,
                 on_overflow: Callable[[], None]) -> None:
        self.loop, self.cumulative, self.max_bytes, self.on_overflow = loop, cumulative, max_bytes, on_overflow
        self._lock = threading.Lock()  # the step thread puts, the loop's thread gets
        self._pending: RequestOutput | None = None
        self._owned = False  # _pending is this collector's copy (so merging into it touches no engine object)
        self._nbytes = 0  # approx_nbytes of what _pending's completions hold
        self._error: BaseException | None = None
        self._ready = asyncio.Event()  # set (on the loop) after a put into an empty collector
        self._total: RequestOutput | None = None  # a CUMULATIVE request's output so far (consumer side)
        self.overflowed = False
        self._done = False  # the engine put the request's finished output (or failed it)
        self._on_done: Callable[[int], None] | None = None  # called on the loop once _done (when_finished)

    def put(self, output: RequestOutput) -> None:
        """Hand one step's (delta) output to the consumer (from any thread)."""
        with self._lock:
            wake = self._pending is None
            if wake:
                self._pending, self._owned = output, False
            else:
                if not self._owned:
                    self._pending, self._owned = self._pending.copy(), True
                self._pending.add(output, aggregate=True)
            # the prompt logprobs are one list per request that every output of it carries (as it grows):
            # counted once, as long as it is now, not once per step
            self._nbytes += output.approx_nbytes(prompt_logprobs=False)
            held = self._nbytes + output.approx_prompt_logprobs_nbytes()
            overflow = held > self.max_bytes and not output.finished and not self.overflowed
            self.overflowed = self.overflowed or overflow
            on_done = self._finish() if output.finished else None
            unread = held
        if wake:
            self._wake()
        if overflow:
            self.on_overflow()
        if on_done is not None:
            self._call_soon(partial(on_done, unread))

    def when_done(self, callback: Callable[[int], None]) -> None:
        """Call `callback(unread bytes)` (on the loop) once the engine is done with the request, read or
        not; at once (on the loop) when it already is. From the loop's thread."""
        with self._lock:
            self._on_done = callback
            on_done = self._finish() if self._done else None
            unread = self._unread()
        if on_done is not None:
            self._call_soon(partial(on_done, unread))

    def _unread(self) -> int:
        """approx_nbytes of the output waiting for the consumer (under the lock)."""
        if self._pending is None:
            return 0
        return self._nbytes + self._pending.approx_prompt_logprobs_nbytes()

    def _finish(self) -> Callable[[int], None] | None:
        """Mark the request done (under the lock); the callback to call, taken so it runs once."""
        self._done = True
        on_done, self._on_done = self._on_done, None
        return on_done

    def _call_soon(self, callback: Callable[[], None]) -> None:
        try:
            self.loop.call_soon_threadsafe(callback)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("dropped a wake-up for a closed event loop")

    def fail(self, exc: BaseException) -> None:
        """End the stream with `exc`, raised once the pending output was taken (from any thread)."""
        with self._lock:
            self._error = exc
            on_done = self._finish()
            unread = self._unread()
        self._wake()
        if on_done is not None:
            self._call_soon(partial(on_done, unread))

    async def get(self) -> RequestOutput:
        """The next output (merged from every step since the last get); raises the stream's error."""
        while True:
            with self._lock:
                output, self._pending, self._nbytes = self._pending, None, 0
                error = self._error
                self._ready.clear()  # on the loop's thread: a set() scheduled by a later put runs after it
            if output is not None:
                return self._cumulative(output) if self.cumulative else output
            if error is not None:
                raise error
            await self._ready.wait()

    def _cumulative(self, delta: RequestOutput) -> RequestOutput:
        if self._total is None:
            self._total = delta.copy()
        else:
            for completion in self._total.outputs:
                completion.text_delta = ""  # the text since the previous output handed out
            self._total.add(delta, aggregate=True)
        return self._total.copy()  # the consumer may keep it; _total goes on growing

    def _wake(self) -> None:
        self._call_soon(self._ready.set)


class AsyncLLMEngine(AdapterAPI):
    """Serve an LLMEngine to asyncio code: ``async for output in engine.generate(...)``.

    It is the server's EngineClient (lora_runner.engine.protocol): the model, limits, tokenizer,
    adapter management and stats below are what the entrypoints use of the engine.

    Args:
        engine: the engine to drive; this object owns it from now on (``shutdown`` closes it).
        start: start the step thread now (else call ``start()``).
        max_pending_output_bytes: unread output one request may hold (see _OutputCollector); past it
            the request is aborted (its outputs end with finish_reason "abort").
    """

    def __init__(self, engine: LLMEngine, start: bool = True,
                 max_pending_output_bytes: int = MAX_PENDING_OUTPUT_BYTES) -> None:
        if max_pending_output_bytes < 1:
            raise ValueError(f"max_pending_output_bytes must be >= 1, got {max_pending_output_bytes}")
        self.engine = engine
        self.max_pending_output_bytes = max_pending_output_bytes
        self._wake = threading.Condition()
        self._streams: dict[str, _OutputCollector] = {}  # guarded by _wake
        self._stopping = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lora-runner-step", daemon=True)
        self._intake = ThreadPoolExecutor(1, thread_name_prefix="lora-runner-intake")  # add_request, in order
        self._accepts_tenant = "tenant" in inspect.signature(engine.add_request).parameters
        self._accepts_cache_salt = "cache_salt" in inspect.signature(engine.add_request).parameters
        self.num_aborted = 0  # requests aborted through abort() (closed or cancelled iterators included)
        if start:
            self.start()

    @classmethod
    def from_config(cls, model, **kwargs) -> AsyncLLMEngine:
        """Build the LLMEngine (an EngineConfig or a model plus EngineConfig keywords) and wrap it."""
        return cls(LLMEngine(model, **kwargs))

    def start(self) -> None:
        """Start the step thread."""
        self._thread.start()

    @property
    def is_running(self) -> bool:
        """True while the step thread serves requests and the engine can (its tensor-parallel workers live)."""
        return self._thread.is_alive() and self._error is None and not self._stopping and self.engine.is_alive

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the step thread, if any."""
        return self._error

    # ----------------------------------------------------------------------------- EngineClient
    @property
    def model_name(self) -> str:
        """The base model as configured (a local directory or a Hub repo id)."""
        return self.engine.config.model

    @property
    def max_model_len(self) -> int:
        """Prompt plus generated tokens one request may hold."""
        return self.engine.limits.max_model_len

    @property
    def max_logprobs(self) -> int:
        """The most logprobs one request may ask for (-1: no cap)."""
        return self.engine.config.max_logprobs

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size."""
        return self.engine.model_config.vocab_size

    def get_tokenizer(self):
        """The model's transformers tokenizer, or None."""
        return self.engine.tokenizer.get()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (ValueError when the model has no tokenizer)."""
        return self.engine.tokenizer.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids` without special tokens ("" without a tokenizer)."""
        return self.engine.tokenizer.decode(token_ids)

    def _adapter_seam(self, check_open: bool = True) -> EngineAdapters:
        """The engine's EngineAdapters: add_lora, serve_adapter, ... (AdapterAPI) block while an adapter loads."""
        return self.engine._adapter_seam(check_open)

    def get_stats(self) -> EngineStats:
        """The engine after its latest step (LLMEngine.stats; safe from any thread)."""
        return self.engine.stats

    # ----------------------------------------------------------------------------- asyncio side
    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       lora_request: LoRARequest | None = None,
                       prompt_adapter_request: PromptAdapterRequest | None = None,
                       tenant: str | None = None, cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its RequestOutputs, the last one with ``finished`` set.

        Raises what ``LLMEngine.add_request`` raises (ValueError, AdapterError) before the first
        output (add_request runs in the engine's one intake thread, off the event loop, in call order), EngineDeadError when the step thread is gone, or the exception that killed it.
        Closing or cancelling the iterator early aborts the request. tenant: passed on to the
        engine's fair scheduling when its add_request takes it, else unused. cache_salt: passed on
        likewise (the prefix cache's separation of tenants, LLMEngine.add_request). Outputs not read yet
        are merged into one (params.output_kind says whether each holds everything so far or only
        what is new); a request with over max_pending_output_bytes unread is aborted.
        """
        params = SamplingParams() if params is None else params
        cumulative = params.output_kind is not RequestOutputKind.DELTA
        stream = _OutputCollector(asyncio.get_running_loop(), cumulative, self.max_pending_output_bytes,
                                  partial(self._overflowed, request_id))
        self._register(request_id, stream)
        # add_request validates, copies (a constraint's schema too, n times) and tokenizes: in the one intake
        # thread, off the loop that serves every other stream; one thread keeps the callers' order
        added = asyncio.get_running_loop().run_in_executor(
            self._intake, partial(self._add, request_id, prompt, _as_delta(params), lora_request,
                                  prompt_adapter_request, tenant, cache_salt))
        try:
            await asyncio.shield(added)
        except BaseException:
            self._unregister(request_id, stream)
            if not added.done():  # cancelled while adding: abort the request once it is in
                added.add_done_callback(partial(self._abort_added, request_id))
            raise
        finished = False
        try:
            while not finished:
                try:
                    item = await stream.get()
                except Exception:
                    finished = True  # the engine is dead or shut down: nothing left to abort
                    raise
                finished = item.finished
                yield item
        finally:
            self._unregister(request_id, stream)
            if not finished:
                self.abort(request_id)

    def when_finished(self, request_id: str, callback: Callable[[int], None]) -> None:
        """Call `callback(unread bytes)` on the caller's loop once the engine has finished `request_id` (its
        last output handed to its collector, or its stream failed), even while that output waits for a
        consumer that does not read: the engine holds nothing for it any more; the argument is what
        the collector still holds (RequestOutput.approx_nbytes). At once (0) for an id without a live
        iterator (finished and read, aborted). From the loop that runs the request's ``generate``."""
        with self._wake:
            stream = self._streams.get(request_id)
        if stream is None:
            asyncio.get_running_loop().call_soon(callback, 0)
        else:
            stream.when_done(callback)

    def _abort_added(self, request_id: str, added: asyncio.Future) -> None:
        if not added.cancelled() and added.exception() is None:
            self.abort(request_id)

    def _overflowed(self, request_id: str) -> None:
        logger.warning("request %r: over %d bytes of output unread by its consumer; aborting it",
                       request_id, self.max_pending_output_bytes)
        self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (unknown or finished ids are ignored); its iterator ends without output."""
        if self._error is not None or not self._thread.is_alive():
            return
        self.num_aborted += 1
        self.engine.abort_request(request_id)
        self._notify()

    def abort_all(self) -> None:
        """Abort every request with a live iterator; each ends with its "abort" output."""
        with self._wake:
            ids = list(self._streams)
        if ids and self._error is None and self._thread.is_alive():
            self.engine.abort_request(ids)
            self._notify()

    def _add(self, request_id, prompt, params, lora_request, prompt_adapter_request, tenant, cache_salt) -> None:
        if not self.is_running:
            raise EngineDeadError("the engine is not running" + (f": {self._error!r}" if self._error else ""))
        kwargs = {"tenant": tenant} if self._accepts_tenant and tenant is not None else {}
        if cache_salt is not None:
            if not self._accepts_cache_salt:  # never drop a salt silently: it separates tenants
                raise ValueError("this engine's add_request takes no cache_salt")
            kwargs["cache_salt"] = cache_salt
        self.engine.add_request(request_id, prompt, params, lora_request=lora_request,
                                prompt_adapter_request=prompt_adapter_request, **kwargs)
        self._notify()

    def _register(self, request_id: str, stream: _OutputCollector) -> None:
        with self._wake:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream

    def _unregister(self, request_id: str, stream: _OutputCollector) -> None:
        with self._wake:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # ----------------------------------------------------------------------------- step thread
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                outputs = self.engine.step()
                self._dispatch(outputs)
                if not outputs:
                    self._wait_for_adapter_loads()
        except BaseException as exc:  # noqa: BLE001 - delivered to every waiter, then the thread ends
            logger.exception("the engine's step() raised; failing every in-flight request")
            self._fail_all(exc)

    def _wait_for_work(self) -> bool:
        """Sleep until a request is unfinished or shutdown is asked; False to stop."""
        with self._wake:
            while not self._stopping and not self.engine.has_unfinished_requests():
                self._wake.wait()
            return not self._stopping

    def _wait_for_adapter_loads(self) -> None:
        """A step that produced nothing: sleep until the engine has work it can run (returns at
        once when the step did run something, e.g. a prefill chunk that samples nothing)."""
        if not self._stopping:
            self.engine.wait_for_work(ADAPTER_WAIT_TIMEOUT_S)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._wake:
            targets = [(self._streams.get(o.request_id), o) for o in outputs]
        for stream, output in targets:
            if stream is not None:
                stream.put(output)

    def _fail_all(self, exc: BaseException) -> None:
        with self._wake:
            self._error = exc
            streams = list(self._streams.values())
        for stream in streams:
            stream.fail(exc)

    # ----------------------------------------------------------------------------- shutdown
    def num_in_flight(self) -> int:
        """Requests with a live generate() iterator."""
        with self._wake:
            return len(self._streams)

    async def drain(self, timeout: float) -> bool:
        """Wait up to `timeout` s for in-flight requests to finish; True when none is left."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.num_in_flight()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the step thread (waiting at most `timeout` s), close the engine.

        Iterators still waiting get EngineDeadError. Idempotent."""
        with self._wake:
            ids = list(self._streams)
        if ids and self._error is None:
            self.engine.abort_request(ids)
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the step thread did not stop within %.1f s", timeout)
        self._fail_all_if_waiting(EngineDeadError("the engine was shut down"))
        self._intake.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    def _fail_all_if_waiting(self, exc: BaseException) -> None:
        with self._wake:
            streams = list(self._streams.values())
        for stream in streams:
            stream.fail(exc)


def _as_delta(params: SamplingParams) -> SamplingParams:
    """The request's params as the engine runs them: DELTA outputs (the collector rebuilds the
    cumulative form for a CUMULATIVE caller), so no step copies a whole output."""
    if params.output_kind is RequestOutputKind.DELTA:
        return params
    internal = params.clone()
    internal.output_kind = RequestOutputKind.DELTA
    return internal
