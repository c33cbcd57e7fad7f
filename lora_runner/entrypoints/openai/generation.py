"""Running one OpenAI generation request on the async engine: one ChoiceRun per prompt.

Each run follows its request's RequestOutputs and turns them into Deltas (new text, new logprobs,
finish reason), recording time to first token and inter-token latency on the way. With n > 1 a
run's engine request has n samples (sharing the prompt's prefill): prompt p's samples are the
choices p * n .. p * n + n - 1, each with its own Delta. Every run's first
output is awaited before the response starts, so a request that fails at once (bad prompt, adapter
that fails to load) gets a real HTTP status even when streamed.

The engine hands the runs DELTA outputs (only what is new; those not read yet are merged into one),
and nothing between the engine and the socket queues without bound: a streamed response whose
client stops reading waits at most ServerConfig.stream_send_timeout for a send, then its requests
are aborted (their sequence slots and KV blocks freed) and the connection is closed; a client that
disconnects is aborted at once. Once the engine has finished a request, its admission seats go back
even while its client has not read it, its unsent output charged to ServerConfig.max_unsent_bytes.

A chat request with tools reads each sample's text through a tool-call parser (new_parser, one per
sample; lora_runner.entrypoints.openai.tool_calls): what it finds goes out as tool-call deltas instead
of content, and a sample that called a tool and stopped finishes with "tool_calls".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

from fastapi import Request

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.entrypoints.openai.echo import ChoiceExtras, prompt_token_logprobs, vllm_prompt_logprobs
from lora_runner.entrypoints.openai.errors import APIError, api_error_from, error_body, model_not_found
from lora_runner.entrypoints.openai.formatting import (
    ADAPTER_VERSION_HEADER,
    DONE_EVENT,
    CompletionFormat,
    Delta,
    TokenLogprob,
    Usage,
    adapter_provenance,
    sse,
)
from lora_runner.entrypoints.openai.response_body import SharedJSON, whole_response
from lora_runner.entrypoints.openai.send_timeout import TimedStreamingResponse
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant
from lora_runner.entrypoints.openai.tool_calls.deltas import join_calls
from lora_runner.outputs import RequestOutput
from lora_runner.sample.sampler import NonFiniteLogitsError
from lora_runner.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks whether its client is still there


@dataclass(frozen=True)
class Target:
    """The adapters a request runs with, chosen by ``model`` and ``prompt_adapter``."""

    model: str
    lora: LoRARequest | None = None
    prompt_adapter: PromptAdapterRequest | None = None


def resolve_target(state: ServerState, tenant: Tenant, model: str, prompt_adapter: str | None) -> Target:
    """404 (the same for unknown names and names the tenant may not use) unless both names resolve."""
    if model in (state.base_name, state.config.model_path_alias):
        if not tenant.base:
            raise model_not_found(model)
        target = Target(model)
    else:
        served = state.adapter(model, tenant)
        if served is None:
            raise model_not_found(model)
        is_lora = served.kind == "lora"
        target = Target(model, served.request if is_lora else None, None if is_lora else served.request)
    if prompt_adapter is None:
        return target
    served = state.adapter(prompt_adapter, tenant)
    if served is None or served.kind != "prompt_adapter":
        raise model_not_found(prompt_adapter)
    if target.prompt_adapter is not None:
        raise APIError(400, "model already names a prompt adapter; prompt_adapter adds one to a LoRA "
                       "or the base model", "invalid_value")
    return Target(model, target.lora, served.request)


def virtual_tokens(state: ServerState, target: Target) -> int:
    """The placeholder tokens the target's prompt adapter puts before each prompt (0: none, or its
    weights are not loaded now; the engine checks the prompt with them once they are)."""
    if target.prompt_adapter is None:
        return 0
    return state.engine.num_virtual_tokens(target.prompt_adapter.name) or 0


def check_lengths(state: ServerState, prompts: list[list[int]], max_tokens: int, num_virtual: int = 0) -> None:
    """400 for a prompt over the prompt-token limit or a max_tokens that does not fit the context
    (num_virtual: a prompt adapter's placeholder tokens, which take context like prompt tokens)."""
    if max_tokens > state.max_tokens_limit:
        raise APIError(400, f"max_tokens must be <= {state.max_tokens_limit}, got {max_tokens}", "invalid_value")
    virtual = f" + {num_virtual} virtual tokens of the prompt adapter" if num_virtual else ""
    for ids in prompts:
        if len(ids) > state.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than the limit of "
                           f"{state.max_prompt_tokens}", "prompt_too_long")
        if len(ids) + num_virtual + max_tokens > state.max_model_len:
            raise APIError(400, f"this model's maximum context length is {state.max_model_len} tokens, but "
                           f"{len(ids)} prompt tokens{virtual} + {max_tokens} max_tokens were requested",
                           "context_length_exceeded")


def _sample_error(error: BaseException | None, model: str, runs_adapter: bool) -> APIError:
    """The answer for a sample the engine failed: an adapter's non-finite logits are its own fault (422
    naming it; the batch's other rows were sampled), anything else as api_error_from maps it."""
    if isinstance(error, NonFiniteLogitsError) and runs_adapter:
        return APIError(422, f"the adapter `{model}` produced NaN or infinite logits for this request (its "
                        "weights overflow the activations); other requests are unaffected", "non_finite_logits")
    return api_error_from(error or RuntimeError("the request failed"))


@dataclass
class _Sent:
    """What has been sent of one sample (choice)."""

    tokens: int = 0
    done: bool = False  # its finish (or error) was reported
    opened: bool = False  # its first delta (the echoed prompt, the prompt's ids) was made


class ChoiceRun:
    """One prompt's generation (n samples: choices index .. index + n - 1) and what has been sent of it."""

    def __init__(self, state: ServerState, index: int, request_id: str, prompt_ids: list[int],
                 gen: AsyncIterator[RequestOutput], started: float, logprobs_k: int | None, n: int = 1,
                 extras: ChoiceExtras = ChoiceExtras(), echo_text: str | None = None,
                 new_parser: Callable[[], object] | None = None, model: str = "", runs_adapter: bool = False) -> None:
        self.state, self.index, self.request_id, self.prompt_len = state, index, request_id, len(prompt_ids)
        self.prompt_ids, self.extras, self.echo_text = prompt_ids, extras, echo_text
        self.parsers = None if new_parser is None else [new_parser() for _ in range(n)]  # tool calls, per sample
        self.model = model  # the request's `model` (its latency metrics' label)
        self.runs_adapter = runs_adapter  # `model` names an adapter (blamed when its logits are not finite)
        self.gen, self.started, self.logprobs_k = gen, started, logprobs_k
        self.first: RequestOutput | None = None
        self.advance_first: list[Delta] = []  # the first output's deltas, sent before the rest
        self.sent = [_Sent() for _ in range(n)]
        self.last_token_at: float | None = None
        self.num_output_tokens = 0
        self.num_cached_tokens = 0  # the prompt's tokens served from the prefix cache
        # the prompt's logprobs entries, built once for the prompt and shared by its n samples' first deltas
        self._echoed: list[TokenLogprob] | None = None
        self._scored: SharedJSON | None = None

    @property
    def choice_indices(self) -> range:
        """The choice index of each sample."""
        return range(self.index, self.index + len(self.sent))

    def advance(self, output: RequestOutput) -> list[Delta]:
        """Each sample's delta in `output` (a DELTA output: what is new since the last call; samples
        without news left out); APIError for a sample that failed (reported once)."""
        num_new = 0 if self.extras.discard_generated else sum(len(c.token_ids) for c in output.outputs)
        self._record_latency(num_new)  # (a finished sample's later deltas are empty)
        if output.finished:
            self.state.metrics.request_finished(self.model, time.monotonic() - self.started, output.metrics)
        self.num_output_tokens += num_new
        self.num_cached_tokens = output.num_cached_tokens
        deltas = [self._advance_sample(sample, completion, output)
                  for sample, completion in enumerate(output.outputs)]
        return [delta for delta in deltas if delta is not None]

    def _advance_sample(self, sample: int, completion, output: RequestOutput) -> Delta | None:
        sent = self.sent[sample]
        if sent.done:
            return None
        new_ids = [] if self.extras.discard_generated else completion.token_ids
        sent.tokens += len(new_ids)
        if completion.finish_reason == "error":
            sent.done = True
            self._finished("error", sent.tokens)
            raise _sample_error(completion.error, self.model, self.runs_adapter)
        # the engine's incremental text: whole characters, stop strings cut
        text = "" if self.extras.discard_generated else completion.text_delta
        logprobs = self._logprobs(completion)
        finish_reason, tool_calls = completion.finish_reason, None
        if self.parsers is not None:  # the generated text only: an echoed prompt is never parsed
            parser = self.parsers[sample]
            extracted = parser.feed(text, completion.finished)
            text, tool_calls = extracted.content, extracted.calls or None
            if completion.finished and parser.called and finish_reason == "stop":
                finish_reason = "tool_calls"
        opening = not sent.opened
        sent.opened = True
        if opening and self.echo_text is not None:
            text = self.echo_text + text
            if self.extras.echo_logprobs:  # also for a sample that opens before it sampled (no logprobs yet)
                logprobs = self._prompt_logprobs(output) + (logprobs or [])
        scored = self._vllm_prompt_logprobs(output) if opening else None
        if completion.finished:
            sent.done = True
            self._finished(finish_reason, sent.tokens)
        if not text and not new_ids and not completion.finished and scored is None:
            return None
        delta = Delta(self.index + sample, text, logprobs, finish_reason, completion.stop_reason,
                      tool_calls=tool_calls, prompt_logprobs=scored)
        if self.extras.return_token_ids:
            delta.token_ids = list(new_ids)
            delta.prompt_token_ids = self.prompt_ids if opening else None
        return delta

    @property
    def echoes_logprobs(self) -> bool:
        """True when its choices start with the echoed prompt's logprobs entries."""
        return self.echo_text is not None and self.extras.echo_logprobs

    def prepare_echo(self, output: RequestOutput) -> None:
        """Build the echoed prompt's entries from `output` (its first), when they came (not in a failed one)."""
        if output.prompt_logprobs is not None:
            self._prompt_logprobs(output)

    def _prompt_logprobs(self, output: RequestOutput) -> list[TokenLogprob]:
        """The prompt tokens' entries echoed before the generated ones (the engine computed them)."""
        if self._echoed is None:
            if output.prompt_logprobs is None:
                raise RuntimeError(f"request {self.request_id}: echo with logprobs, but no prompt logprobs came back")
            self._echoed = prompt_token_logprobs(self._token_text, self.prompt_ids, output.prompt_logprobs,
                                                 self.logprobs_k or 0)
        return self._echoed

    def _vllm_prompt_logprobs(self, output: RequestOutput) -> SharedJSON | None:
        """The request's prompt_logprobs field (vLLM's shape) when it asked for it, else None: one object for
        the prompt's n choices, made and serialised once as the body is written (response_body.SharedJSON)."""
        k = self.extras.prompt_logprobs
        if k is None:
            return None
        if self._scored is None:
            if output.prompt_logprobs is None:
                raise RuntimeError(f"request {self.request_id}: prompt_logprobs asked for, but none came back")
            self._scored = SharedJSON(partial(vllm_prompt_logprobs, self.state.token_text, self.prompt_ids,
                                              output.prompt_logprobs, k))
        return self._scored

    def _logprobs(self, completion) -> list[TokenLogprob] | None:
        if completion.logprobs is None:
            return None
        if self.extras.discard_generated:
            return []
        k = self.logprobs_k or 0
        return [_token_logprob(self._token_text, token, table, k)
                for token, table in zip(completion.token_ids, completion.logprobs)]

    def _token_text(self, token: int) -> str:
        """A token's text in logprobs: "token_id:N" with return_tokens_as_token_ids (vLLM's; a token that is
        part of a character, as an emoji's bytes, has no text of its own: decoded it is U+FFFD)."""
        return f"token_id:{token}" if self.extras.return_tokens_as_token_ids else self.state.token_text(token)

    def _record_latency(self, num_new: int) -> None:
        if num_new == 0:
            return
        now = time.monotonic()
        metrics = self.state.metrics
        label = metrics.model_label(self.model)
        if self.last_token_at is None:
            metrics.ttft.labels(label).observe(now - self.started)
        else:
            metrics.itl.labels(label).observe((now - self.last_token_at) / num_new)
        self.last_token_at = now

    def _finished(self, reason: str | None, num_tokens: int) -> None:
        self.state.metrics.finished.labels(reason or "unknown").inc()
        self.state.metrics.generation_tokens.inc(num_tokens)

    async def close(self) -> None:
        """Close the iterator (aborting an unfinished request)."""
        try:
            await self.gen.aclose()
        except RuntimeError:  # still being iterated by a cancelled task: abort directly
            self.state.engine.abort(self.request_id)


def _token_logprob(token_text: Callable[[int], str], token: int, table: dict[int, float], k: int) -> TokenLogprob:
    top = sorted(table.items(), key=lambda item: -item[1])[:k]
    return TokenLogprob(token_text(token), table[token], [(token_text(t), lp) for t, lp in top])


async def _first_output(run: ChoiceRun) -> None:
    try:
        run.first = await run.gen.__anext__()
    except StopAsyncIteration:
        raise RuntimeError(f"request {run.request_id} ended without output") from None


def engine_cache_salt(state: ServerState, tenant: Tenant, request_salt: str | None) -> str | None:
    """The engine's cache salt of a request: the tenant's name (unless the server turned tenant salting
    off) combined with the body's ``cache_salt``, which adds to the tenant's, never replaces it."""
    parts = [tenant.name if state.config.prefix_cache_tenant_salt else None, request_salt]
    return None if parts == [None, None] else json.dumps(parts)


async def start_runs(state: ServerState, tenant: Tenant, target: Target, prompts: list[list[int]],
                     params: SamplingParams, started: float, request_salt: str | None = None,
                     extras: ChoiceExtras = ChoiceExtras(),
                     new_parser: Callable[[], object] | None = None) -> list[ChoiceRun]:
    """Add one engine request per prompt and wait for each one's first output (errors raise).
    new_parser: a tool-call parser for each sample (None: plain content)."""
    runs = []
    salt = engine_cache_salt(state, tenant, request_salt)
    params = dataclasses.replace(params, output_kind=RequestOutputKind.DELTA)  # the runs read deltas
    for index, ids in enumerate(prompts):
        request_id = state.new_id("req")
        gen = state.engine.generate(ids, params, request_id, target.lora, target.prompt_adapter, tenant=tenant.name,
                                    cache_salt=salt)
        runs.append(ChoiceRun(state, index * params.n, request_id, ids, gen, started, params.logprobs, params.n,
                              extras, extras.echo_text(index), new_parser, model=target.model,
                              runs_adapter=target.lora is not None or target.prompt_adapter is not None))
    results = await asyncio.gather(*(_first_output(run) for run in runs), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    try:
        if errors:  # mapped here: a bare ValueError of add_request reaching the app's handler dropped the connection
            raise api_error_from(errors[0]) if isinstance(errors[0], Exception) else errors[0]
        for run in runs:  # an adapter that failed to load shows up here, before any byte is sent
            if run.echoes_logprobs:  # a long echoed prompt's entries take a while: built on the prompt pool
                await state.off_loop(run.prepare_echo, run.first)
            run.advance_first = run.advance(run.first)
    except BaseException:
        await close_runs(runs)
        raise
    return runs


async def close_runs(runs: list[ChoiceRun]) -> None:
    """Close every run's iterator (aborting what is unfinished)."""
    for run in runs:
        await run.close()


async def merged(runs: list[ChoiceRun]) -> AsyncIterator[tuple[ChoiceRun, RequestOutput | BaseException]]:
    """(run, output) for every output after each run's first, in arrival order. At most one item
    per run waits here: a consumer that is slow (a client that does not read) leaves the outputs in
    the engine's collectors, which merge them."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(runs))

    async def pump(run: ChoiceRun) -> None:
        try:
            if not run.first.finished:
                async for output in run.gen:
                    await queue.put((run, output))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which reports it
            await queue.put((run, exc))
        await queue.put((run, None))

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        remaining = len(runs)
        while remaining:
            run, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield run, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _SeatsBackWhenDone:
    """Gives a request's seats back once the engine has finished every run, not when its client has
    read the response: a client that stops reading would otherwise hold them until the send timeout.
    What the finished runs still hold unsent is charged to ServerConfig.max_unsent_bytes (ServerState.
    hold_unsent); over what is left the seats stay taken (the bound on memory they gave). ``end`` (when
    the response ends) refunds the charge. An engine client without ``when_finished``: the seats go
    back with the response, as before."""

    def __init__(self, state: ServerState, runs: list[ChoiceRun], release: Callable[[], None]) -> None:
        self.state, self.release = state, release
        self.pending = {run.request_id for run in runs}
        self.unread = 0  # bytes the finished runs' collectors held when they finished
        self.ended = False
        self.refund: Callable[[], None] | None = None
        when_finished = getattr(state.engine, "when_finished", None)
        for run in runs if when_finished is not None else ():
            when_finished(run.request_id, partial(self._done, run.request_id))

    def _done(self, request_id: str, nbytes: int) -> None:
        self.pending.discard(request_id)
        self.unread += nbytes
        if not self.pending and not self.ended:  # a response that ended first has nothing left to charge
            self.refund = self.state.hold_unsent(self.unread)
            if self.refund is not None:
                self.release()

    def end(self) -> None:
        """The response ended: what was charged is free again."""
        self.ended = True
        if self.refund is not None:
            self.refund()


class _ClosingStreamingResponse(TimedStreamingResponse):
    """Runs `cleanup` however the response ends: a client that went away, one that was gone before
    the body started (then the body iterator never ran, so its own cleanup cannot), or one that
    stopped reading (a send waited over the send timeout)."""

    def __init__(self, content, cleanup: Callable, send_timeout: float, **kwargs) -> None:
        super().__init__(content, send_timeout, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def run_generation(state: ServerState, request: Request, tenant: Tenant, target: Target,
                         prompts: list[list[int]], params: SamplingParams, fmt: CompletionFormat,
                         stream: bool, include_usage: bool, started: float, release: Callable[[], None],
                         cache_salt: str | None = None, continuous_usage: bool = False,
                         extras: ChoiceExtras = ChoiceExtras(), new_parser: Callable[[], object] | None = None,
                         on_body_end: Callable[[], None] = lambda: None):
    """Start and answer one generation request (streamed or whole) on the seats the caller took
    (ServerState.admit); `release` (idempotent) gives them back however the request ends. A whole response's
    body is built and serialised off the event loop (response_body.whole_response), and `on_body_end` is called
    once it was sent (the refund of the bytes reserved for it; the caller's when this raises). cache_salt:
    the body's (combined with the tenant's, engine_cache_salt). continuous_usage: every streamed chunk
    carries the usage so far (stream_options.continuous_usage_stats). extras: echo and token ids
    (lora_runner.entrypoints.openai.echo). new_parser: the tool-call parser of each sample (a chat request
    with tools)."""
    try:
        state.metrics.requests.labels(target.model).inc()
        state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
        runs = await start_runs(state, tenant, target, prompts, params, started, cache_salt, extras, new_parser)
    except BaseException:
        release()
        raise
    seats = _SeatsBackWhenDone(state, runs, release)
    # every prompt's request was admitted by now (start_runs waited for its first output): its version is known
    fmt.adapter = adapter_provenance(runs[0].first)
    headers = {} if fmt.adapter is None else {ADAPTER_VERSION_HEADER: str(fmt.adapter["version"])}
    if stream:
        async def cleanup() -> None:
            await close_runs(runs)
            release()
            seats.end()

        return _ClosingStreamingResponse(_events(runs, fmt, include_usage, cleanup, continuous_usage), cleanup,
                                         state.config.stream_send_timeout, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
    try:
        deltas, usage = await _cancel_on_disconnect(request, _collect(runs))
    finally:
        await close_runs(runs)
        release()
        seats.end()
    return await whole_response(state.off_loop, partial(fmt.response, deltas, usage), headers,
                                state.config.stream_send_timeout, on_body_end)


def _usage(runs: list[ChoiceRun]) -> Usage:
    return Usage(sum(r.prompt_len for r in runs), sum(r.num_output_tokens for r in runs),
                 sum(r.num_cached_tokens for r in runs))


async def _collect(runs: list[ChoiceRun]) -> tuple[list[Delta], Usage]:
    """Every choice's whole Delta (by index) and the usage, once every run finished."""
    totals = {choice: Delta(choice, logprobs=None) for run in runs for choice in run.choice_indices}
    for delta in (d for run in runs for d in run.advance_first):
        totals[delta.index] = _join(totals[delta.index], delta)
    async for run, item in merged(runs):
        if isinstance(item, BaseException):
            raise api_error_from(item)
        for delta in run.advance(item):
            totals[delta.index] = _join(totals[delta.index], delta)
    return [totals[choice] for choice in sorted(totals)], _usage(runs)


def _join(total: Delta, delta: Delta | None) -> Delta:
    if delta is None:
        return total
    logprobs = None if delta.logprobs is None else (total.logprobs or []) + delta.logprobs
    token_ids = None if delta.token_ids is None else (total.token_ids or []) + delta.token_ids
    tool_calls = join_calls(total.tool_calls or [], delta.tool_calls) if delta.tool_calls else total.tool_calls
    return Delta(total.index, total.text + delta.text, logprobs, delta.finish_reason, delta.stop_reason,
                 token_ids, total.prompt_token_ids or delta.prompt_token_ids, tool_calls,
                 total.prompt_logprobs if total.prompt_logprobs is not None else delta.prompt_logprobs)


async def _events(runs: list[ChoiceRun], fmt: CompletionFormat, include_usage: bool,
                  cleanup: Callable, continuous_usage: bool = False) -> AsyncIterator[str]:
    def chunk(delta: Delta) -> str:
        return sse(fmt.chunk(delta, include_usage, _usage(runs) if continuous_usage else None))

    async def written(delta: Delta) -> str:  # an echoed or scored prompt's chunk may be MiBs: off the loop
        return await runs[0].state.off_loop(chunk, delta) if _is_large(delta) else chunk(delta)

    rest = merged(runs)
    try:
        for run in runs:
            if fmt.role_chunk:
                for choice in run.choice_indices:
                    yield sse(fmt.opening_chunk(choice, include_usage))
            for delta in run.advance_first:
                yield await written(delta)
        async for run, item in rest:
            try:
                if isinstance(item, BaseException):
                    raise api_error_from(item)
                deltas = run.advance(item)
            except APIError as err:  # this choice failed mid-stream: tell the client, go on with the rest
                yield sse(error_body(err.status, err.message, err.code))
                continue
            for delta in deltas:
                yield await written(delta)
        if include_usage:
            yield sse(fmt.usage_chunk(_usage(runs)))
        yield DONE_EVENT
    finally:
        await rest.aclose()
        await cleanup()


LARGE_DELTA_TOKENS = 64  # tokens with logprobs (an echoed prompt's) past which a chunk is serialised off the loop


def _is_large(delta: Delta) -> bool:
    return delta.prompt_logprobs is not None or len(delta.logprobs or ()) > LARGE_DELTA_TOKENS


async def _cancel_on_disconnect(request: Request, coro):
    """Await `coro`; cancel it (so its requests are aborted) when the client disconnects first."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client disconnected", "client_disconnected")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
