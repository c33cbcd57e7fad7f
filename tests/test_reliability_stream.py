"""A consumer that never reads holds nothing (issue 23, item 7).

Engine level: a request whose consumer does not read while many steps run has at most one pending,
merged output, equal to what a reading consumer got; what it may buffer is bounded in bytes (past
the bound the request is aborted). HTTP level: a streaming client that stops reading is aborted
after the server's send timeout, the engine's and the server's slots come back, and another
tenant's stream meanwhile completes with exact tokens.
"""

import asyncio
import json
import socket
import time

import pytest

from lora_runner import LLMEngine, SamplingParams
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.outputs import RequestOutput
from lora_runner.sampling_params import RequestOutputKind

WAIT_S = 60.0  # generous bound on anything the tests wait for (they assert on events, never on speed)


def _params(**overrides) -> SamplingParams:
    kwargs = dict(temperature=1.0, seed=11, n=4, max_tokens=40, logprobs=3, ignore_eos=True, stop=["zzz"])
    kwargs.update(overrides)
    return SamplingParams(**kwargs)


def _offline(model_dir: str, prompt: str, params: SamplingParams) -> RequestOutput:
    """The oracle: LLM.generate (the engine's cumulative outputs, no merging anywhere)."""
    from lora_runner import LLM

    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=512)
    try:
        return llm.generate([prompt], params, use_tqdm=False)[0]
    finally:
        llm.close()


@pytest.fixture
def engine_factory(engine_checkpoint):
    made = []

    def make(**kwargs) -> AsyncLLMEngine:
        model_dir, _, _ = engine_checkpoint
        engine = AsyncLLMEngine(LLMEngine(model_dir, device="cpu", dtype="float32", max_model_len=512), **kwargs)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.shutdown()


def _count_steps(engine: AsyncLLMEngine) -> list:
    calls, step = [], engine.engine.step

    def counting_step():
        calls.append(None)
        return step()

    engine.engine.step = counting_step
    return calls


async def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _summary(output: RequestOutput) -> list[tuple]:
    """Everything a caller reads of each completion (the sum of the chosen logprobs included)."""
    return [(c.index, list(c.token_ids), c.text, c.logprobs, c.finish_reason, c.stop_reason,
             sum(table[token] for token, table in zip(c.token_ids, c.logprobs or [])))
            for c in output.outputs]


async def _stalled(engine: AsyncLLMEngine, prompt, params: SamplingParams, request_id: str):
    """(first output, the outputs read once the engine finished the request without being read)."""
    gen = engine.generate(prompt, params, request_id)
    first = await gen.__anext__()
    await _until(lambda: not engine.engine.has_unfinished_requests(), "the request to finish in the engine")
    rest = [output async for output in gen]
    return first, rest


def test_a_consumer_that_does_not_read_gets_one_merged_output_equal_to_a_readers(engine_factory, engine_checkpoint):
    """Many steps run while the consumer reads nothing: one pending output, the reader's content exactly."""
    engine = engine_factory()
    steps = _count_steps(engine)
    prompt = "the cat sat on the mat"

    async def main():
        read = [output async for output in engine.generate(prompt, _params(), "reader")]
        steps.clear()
        first, rest = await _stalled(engine, prompt, _params(), "stalled")
        return read, first, rest

    read, first, rest = asyncio.run(main())
    assert len(steps) >= 20  # the stalled consumer's request ran many steps unread
    assert len(rest) == 1 and rest[0].finished  # at most one pending output: the merged one
    assert _summary(rest[0]) == _summary(read[-1]) == _summary(_offline(engine_checkpoint[0], prompt, _params()))
    assert all(c.finish_reason == "length" and len(c.token_ids) == 40 for c in rest[0].outputs)
    for sample, completion in enumerate(rest[0].outputs):  # the deltas still concatenate to the text
        assert first.outputs[sample].text_delta + completion.text_delta == completion.text


def test_delta_outputs_concatenate_to_the_cumulative_ones(engine_factory, engine_checkpoint):
    """output_kind=DELTA (read or not) carries only what is new; joined, it is the cumulative output."""
    engine = engine_factory()
    prompt = "a red dog and a blue cat"
    stop = ["the"]  # two of the four samples stop early: later merged outputs carry them unchanged

    async def main():
        cumulative = [o async for o in engine.generate(prompt, _params(stop=stop), "cumulative")]
        delta = _params(stop=stop, output_kind=RequestOutputKind.DELTA)
        deltas = [o async for o in engine.generate(prompt, delta, "delta")]
        first, rest = await _stalled(engine, prompt, delta, "stalled")
        return cumulative[-1], deltas, [first, *rest]

    final, deltas, stalled = asyncio.run(main())
    assert {c.finish_reason for c in final.outputs} == {"stop", "length"}
    assert _summary(final) == _summary(_offline(engine_checkpoint[0], prompt, _params(stop=stop)))
    assert len(deltas) > 10 and len(stalled) == 2
    for outputs in (deltas, stalled):
        joined = outputs[0]
        for output in outputs[1:]:
            joined.add(output, aggregate=True)
        assert _summary(joined) == _summary(final)
    assert all(len(c.token_ids) <= 4 for c in deltas[1].outputs)  # a delta: this step's tokens, not all so far


def test_what_a_slow_consumer_buffers_is_bounded_in_bytes(engine_factory):
    """Past max_pending_output_bytes the unread request is aborted; a reader with the same bound is not."""
    bound = 40_000
    engine = engine_factory(max_pending_output_bytes=bound)
    params = _params(max_tokens=120, logprobs=8)

    async def main():
        reader = asyncio.ensure_future(_read_all(engine.generate("hello world", params, "reader")))
        _, rest = await _stalled(engine, "the cat sat on the mat", params, "stalled")
        return await reader, rest

    read, rest = asyncio.run(main())
    assert [c.finish_reason for c in read.outputs] == ["length"] * 4
    assert len(rest) == 1 and [c.finish_reason for c in rest[0].outputs] == ["abort"] * 4
    held = rest[0].approx_nbytes()
    step_bytes = 4 * RequestOutput.approx_token_nbytes(params.logprobs)
    assert held <= bound + 3 * step_bytes  # the bound, plus the steps until the abort took effect
    assert sum(len(c.token_ids) for c in rest[0].outputs) < 4 * 120


def _prompt_logprobs(num_tokens: int, k: int) -> list:
    return [None] + [{token: -1.0 - token for token in range(k + 1)} for _ in range(num_tokens - 1)]


def test_approx_nbytes_counts_the_prompt_logprobs():
    from lora_runner.outputs import LOGPROB_ENTRY_NBYTES, LOGPROBS_DICT_NBYTES, CompletionOutput

    plain = RequestOutput("r", list(range(500)), [CompletionOutput(0, [1, 2], "ab")])
    scored = RequestOutput("r", list(range(500)), [CompletionOutput(0, [1, 2], "ab")],
                           prompt_logprobs=_prompt_logprobs(500, k=5))
    assert scored.approx_nbytes() - plain.approx_nbytes() == 499 * (LOGPROBS_DICT_NBYTES + 6 * LOGPROB_ENTRY_NBYTES)
    assert scored.approx_nbytes(prompt_logprobs=False) == plain.approx_nbytes()


def test_an_unread_outputs_prompt_logprobs_count_toward_the_bound_once():
    """The pending-output bound sees a request's prompt logprobs (one list, shared by all its outputs) once:
    a big one alone overflows, a smaller one carried by many unread steps does not."""
    from lora_runner.engine.async_llm_engine import _OutputCollector
    from lora_runner.outputs import CompletionOutput

    def delta(step: int, tables: list) -> RequestOutput:
        return RequestOutput("r", [0] * len(tables), [CompletionOutput(0, [step], "x", text_delta="x")],
                             prompt_logprobs=tables)

    async def main(tables: list, steps: int, bound: int) -> list:
        overflows = []
        collector = _OutputCollector(asyncio.get_running_loop(), False, bound, lambda: overflows.append(1))
        for step in range(steps):
            collector.put(delta(step, tables))
        return overflows

    small, big = _prompt_logprobs(200, k=5), _prompt_logprobs(2000, k=5)
    bound = 2 * delta(0, small).approx_nbytes()
    assert asyncio.run(main(big, 1, bound)) == [1]  # its prompt logprobs alone are over the bound
    assert asyncio.run(main(small, 300, bound)) == []  # counted per step, 300 copies would be far over


async def _read_all(gen) -> RequestOutput:
    outputs = [output async for output in gen]
    return outputs[-1]


# ---------------------------------------------------------------------------------------------- HTTP
def _stalled_stream(port: int, body: dict) -> socket.socket:
    """A streaming request from a client that never reads (a receive buffer as small as it gets)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def _drain(sock: socket.socket) -> bytes:
    sock.settimeout(WAIT_S)
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    return data


def test_a_streaming_client_that_stops_reading_is_aborted_after_the_send_timeout(engine_checkpoint, tmp_path):
    """n=4 with logprobs, never read: aborted after --stream-send-timeout, slots freed; a bystander is exact."""
    from openai import OpenAI
    from serve_support import model_with_chat_template, offline_greedy, serve_args, serve_configs

    from lora_runner.entrypoints.launch import build_state
    from lora_runner.entrypoints.openai.app import build_app
    from lora_runner.entrypoints.openai.background import BackgroundServer

    model_dir = model_with_chat_template(engine_checkpoint[0], tmp_path / "model")
    expected = offline_greedy(model_dir, [("one two three", None, None)], 24, {})[0]
    state = build_state(*serve_configs(serve_args(model_dir, {}, extra=["--stream-send-timeout", "1.0"])))
    server = BackgroundServer(build_app(state))
    # accepted sockets inherit it: the kernel buffers 16 KiB for the stalled client instead of
    # autotuning up to tcp_wmem's 4 MiB, which would take the whole answer without blocking a send
    server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    server.start()
    try:
        sock = _stalled_stream(server.port, {"model": "base", "prompt": "the cat sat on the mat", "n": 4,
                                             "max_tokens": 200, "ignore_eos": True, "logprobs": 5,
                                             "temperature": 1.0, "seed": 3, "stream": True})
        engine = state.engine
        deadline = time.monotonic() + WAIT_S
        while engine.num_in_flight() == 0:  # the stalled stream started
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        stream = client.completions.create(model="base", prompt="one two three", max_tokens=24, temperature=0,
                                           logprobs=0, stream=True)
        tokens = [t for chunk in stream for t in chunk.choices[0].logprobs.tokens]
        vocab = state.tokenizer.get_vocab()
        assert [vocab[t] for t in tokens] == expected  # the bystander, while the stalled stream is held

        deadline = time.monotonic() + WAIT_S
        while engine.num_in_flight() or state._in_flight:
            assert time.monotonic() < deadline, "the stalled stream was never given up"
            time.sleep(0.05)
        while (engine.get_stats().running, engine.get_stats().waiting) != (0, 0):  # the step that takes the abort
            assert time.monotonic() < deadline, "the aborted request kept its sequence slots"
            time.sleep(0.05)
        received = _drain(sock)
        assert engine.num_aborted >= 1  # what the server managed to send, then it closed the connection
        assert received.startswith(b"HTTP/1.1 200") and b"data: [DONE]" not in received
        sock.close()
    finally:
        server.stop()


def test_the_send_timeout_is_a_checked_server_option():
    """--stream-send-timeout reaches ServerConfig; a value <= 0 is refused with a clear message."""
    from lora_runner.entrypoints.openai.state import ServerConfig

    assert ServerConfig(served_model_name="m").stream_send_timeout > 0
    with pytest.raises(ValueError, match="stream_send_timeout"):
        ServerConfig(served_model_name="m", stream_send_timeout=0)

