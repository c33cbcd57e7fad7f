"""Scoring amplification and the event loop (issue 39 items 6 and 1), through the real HTTP app.

- A prompt's vLLM prompt_logprobs are built and serialised once for its n choices (before: once per
  choice, n copies held), and every choice still carries them (the shape clients read).
- A whole response is built and serialised off the event loop (the prompt pool's threads), a chunk at a
  time; a stream's chunk that carries a prompt's logprobs is serialised there too.
- A whole response's logprob bytes are reserved in its tenant's share of --max-unsent-bytes until its
  body was sent: a tenant whose unread response holds its share gets 429 for the next, naming the
  setting, while another tenant is served; the share is back once the connection goes.
- add_request (validation, copies, tokenizing) runs in the async engine's one intake thread, in the order
  of the prompts; a request cancelled while it is being added is aborted once it is in.
- A step whose constrained requests' masks together pass structured_outputs_step_mask_budget_ms fails its
  slowest request alone (each under the per-request budget); the others finish.

Counts and events only, no timing assertions (bench_tenant_isolation.py measures the latency).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_support import PROMPTS, WAIT_S, model_with_chat_template, serve_args, serve_configs, wait_until

KEYS = {"sk-tenant-a": {"name": "a", "base": True}, "sk-tenant-b": {"name": "b", "base": True}}
MAX_UNSENT = 1_000_000  # two tenants: a share of 500 kB each
LONG_PROMPT = "the cat sat on the mat and the dog said yes " * 6  # 66 tokens


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state) with tenants a and b, --max-unsent-bytes MAX_UNSENT and a small send buffer (so a
    client that does not read blocks the server's sends)."""
    from lora_runner.entrypoints.launch import build_state
    from lora_runner.entrypoints.openai.app import build_app
    from lora_runner.entrypoints.openai.background import BackgroundServer

    work = tmp_path_factory.mktemp("scoring")
    model_dir = model_with_chat_template(engine_checkpoint[0], work / "model")
    keys = work / "keys.json"
    keys.write_text(json.dumps(KEYS))
    state = build_state(*serve_configs(serve_args(model_dir, {}, extra=[
        "--tenant-keys", str(keys), "--max-unsent-bytes", str(MAX_UNSENT), "--stream-send-timeout", "600"])))
    server = BackgroundServer(build_app(state))
    server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)
    server.start()
    yield server, state
    server.stop()


def _client(served, key: str = "sk-tenant-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=key, max_retries=0, timeout=WAIT_S)


def _complete(served, body: dict, key: str = "sk-tenant-a"):
    """completions.create through the openai client (vLLM's prompt_logprobs in its extra body)."""
    plain = {k: v for k, v in body.items() if k != "prompt_logprobs"}
    return _client(served, key).completions.create(**plain, extra_body={"prompt_logprobs": body["prompt_logprobs"]})


def _recording(monkeypatch, owner, name: str) -> list[str]:
    """The names of the threads `owner.name` is called on from now on."""
    threads, real = [], getattr(owner, name)

    def recorded(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, recorded)
    return threads


def test_a_prompts_logprobs_are_built_and_serialised_once_for_its_n_choices_off_the_loop(served, monkeypatch):
    from lora_runner.entrypoints.openai import generation, response_body

    built = _recording(monkeypatch, generation, "vllm_prompt_logprobs")
    serialised = _recording(monkeypatch, response_body, "_dumps")  # a SharedJSON's one serialisation
    body = {"model": "base", "prompt": PROMPTS[:2], "n": 4, "max_tokens": 2, "prompt_logprobs": 3,
            "temperature": 1.0, "seed": 0}
    response = httpx.post(served[0].base_url + "/v1/completions", json=body, timeout=WAIT_S,
                          headers={"Authorization": "Bearer sk-tenant-a"})
    assert response.status_code == 200, response.text
    by_index = {c["index"]: c["prompt_logprobs"] for c in response.json()["choices"]}
    assert sorted(by_index) == list(range(8))  # each choice carries its prompt's, as vLLM's do
    for index, scored in by_index.items():
        assert scored == by_index[index // 4 * 4]
        assert len(scored) == len(served[1].tokenizer.encode(PROMPTS[index // 4])) and scored[0] is None
    assert len(built) == 2 and len(serialised) == 2  # once per prompt, not per choice
    assert all(name.startswith("lora-runner-prompts") for name in built + serialised), built + serialised  # off the loop


def test_a_streamed_echoed_prompts_chunks_are_serialised_off_the_loop(served, monkeypatch):
    from lora_runner.entrypoints.openai import generation

    made, real = [], generation.sse

    def recorded(payload):
        logprobs = payload["choices"][0]["logprobs"] if payload.get("choices") else None
        made.append((threading.current_thread().name, len(logprobs["tokens"]) if logprobs else 0))
        return real(payload)

    monkeypatch.setattr(generation, "sse", recorded)
    built = _recording(monkeypatch, generation, "prompt_token_logprobs")
    stream = _client(served).completions.create(model="base", prompt=[LONG_PROMPT] * 2, n=4, max_tokens=2, echo=True,
                                                logprobs=3, stream=True, temperature=1.0, seed=0)
    assert len([chunk for chunk in stream]) >= 8
    echoed = [name for name, tokens in made if tokens >= 66]
    assert len(echoed) == 8 and all(name.startswith("lora-runner-prompts") for name in echoed), made
    assert any(not name.startswith("lora-runner-prompts") for name, _ in made)  # small chunks stay on the loop
    # each prompt's echoed entries are built once, on the prompt pool too
    assert len(built) == 2 and all(name.startswith("lora-runner-prompts") for name in built), built


@pytest.mark.parametrize("n", [1, 4])
def test_every_sample_of_an_echoed_prompt_carries_its_logprobs(served, n):
    """Samples after the first open before they sampled anything: their echoed prompt still carries its
    entries (before: only the first sample's did)."""
    ids = served[1].tokenizer.encode(LONG_PROMPT)
    response = _client(served).completions.create(model="base", prompt=[LONG_PROMPT] * 2, n=n, max_tokens=2,
                                                  echo=True, logprobs=1, temperature=1.0, seed=0)
    assert len(response.choices) == 2 * n
    for choice in response.choices:
        assert len(choice.logprobs.tokens) == len(ids) + 2 and choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:len(ids)] == response.choices[0].logprobs.token_logprobs[1:len(ids)]


def test_a_big_whole_response_is_sent_as_it_is_written(served):
    body = {"model": "base", "prompt": [LONG_PROMPT] * 4, "n": 8, "max_tokens": 2, "prompt_logprobs": 20,
            "temperature": 1.0, "seed": 0}
    with httpx.stream("POST", served[0].base_url + "/v1/completions", json=body, timeout=WAIT_S,
                      headers={"Authorization": "Bearer sk-tenant-a"}) as response:
        assert response.status_code == 200
        assert "content-length" not in response.headers  # over one chunk: sent as it is written
        data = b"".join(response.iter_bytes())
    choices = json.loads(data)["choices"]
    assert [c["index"] for c in choices] == list(range(32))
    assert all(len(c["prompt_logprobs"]) == 66 for c in choices)
    small = httpx.post(served[0].base_url + "/v1/completions", json={"model": "base", "prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": "Bearer sk-tenant-a"}, timeout=WAIT_S)
    assert int(small.headers["content-length"]) == len(small.content)  # one chunk: whole, with its length


def test_the_body_is_serialised_on_the_prompt_pool(served, monkeypatch):
    """Every piece of a whole response's JSON (its choices' objects, the shared prompt logprobs) is made on
    the prompt pool's threads, none on the event loop's."""
    from lora_runner.entrypoints.openai import formatting, response_body

    choices = _recording(monkeypatch, formatting.CompletionFormat, "_choice")
    shared = _recording(monkeypatch, response_body.SharedJSON, "text")
    body = {"model": "base", "prompt": [LONG_PROMPT] * 2, "n": 4, "max_tokens": 2, "prompt_logprobs": 5,
            "echo": True, "logprobs": 2}
    response = _complete(served, body)
    assert len(response.choices) == 8
    assert len(choices) == 8 and len(shared) == 8
    assert all(name.startswith("lora-runner-prompts") for name in choices + shared), choices + shared


def _unread_request(port: int, key: str, body: dict) -> socket.socket:
    """A whole (non-streamed) request whose client never reads the response."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (key.encode(), len(payload)) + payload)
    return sock


def test_a_tenants_unread_responses_are_bounded_by_its_share_of_the_unsent_bytes(served):
    """Tenant a's first big whole response, never read, holds its reserved bytes; a's second is a 429 naming
    --max-unsent-bytes before it runs, b's equal one is served (its own share), and a's share is back once
    its connection goes."""
    server, state = served
    body = {"model": "base", "prompt": [LONG_PROMPT] * 4, "n": 16, "max_tokens": 2, "prompt_logprobs": 20,
            "temperature": 1.0, "seed": 0}
    assert state.unsent_bytes == 0
    sock = _unread_request(server.port, "sk-tenant-a", body)
    try:
        wait_until(lambda: state.unsent_bytes > 0 and state.in_flight == 0, "a's response was reserved and ran")
        held = state.unsent_bytes
        assert MAX_UNSENT // 2 < 2 * held and held <= MAX_UNSENT // 2  # one fits a share, two do not
        with pytest.raises(openai.RateLimitError, match="--max-unsent-bytes"):
            _complete(served, body)
        answer = _complete(served, body, "sk-tenant-b")
        assert len(answer.choices) == 64
        assert state.unsent_bytes == held  # b's was refunded once sent; a's is still unread
    finally:
        sock.close()
    wait_until(lambda: state.unsent_bytes == 0, "a closed connection kept its reserved bytes")
    assert len(_complete(served, body).choices) == 64


def test_add_request_runs_in_the_intake_thread_in_prompt_order(served, monkeypatch):
    engine = served[1].engine.engine
    calls, real = [], engine.add_request

    def recorded(request_id, prompt, *args, **kwargs):
        calls.append((threading.current_thread().name, prompt))
        return real(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", recorded)
    prompts = [f"{word} cat sat" for word in ("one", "two", "three", "hello", "red", "blue", "green", "yes")]
    response = _client(served).completions.create(model="base", prompt=prompts, max_tokens=1)
    assert len(response.choices) == 8
    tokenizer = served[1].tokenizer
    assert [prompt for _, prompt in calls] == [tokenizer.encode(p) for p in prompts]
    assert {name for name, _ in calls} == {"lora-runner-intake_0"}


def test_a_request_cancelled_while_it_is_added_is_aborted_once_in(served, monkeypatch):
    """The consumer goes while add_request is still running in the intake thread: once it is in, the
    request is aborted (its iterator is gone, nobody would read it)."""
    from lora_runner import SamplingParams

    async_engine = served[1].engine
    engine = async_engine.engine
    entered, let_go, real = threading.Event(), threading.Event(), engine.add_request

    def slow_add(*args, **kwargs):
        entered.set()
        assert let_go.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", slow_add)
    aborted_before = async_engine.num_aborted
    added_ids = []
    monkeypatch.setattr(engine, "abort_request", lambda ids, real_abort=engine.abort_request: (
        added_ids.append(ids), real_abort(ids)))

    async def consumer_goes():
        gen = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "cancelled-add")
        task = asyncio.ensure_future(gen.__anext__())
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        let_go.set()
        deadline = time.monotonic() + WAIT_S
        while "cancelled-add" not in added_ids and time.monotonic() < deadline:  # the loop runs the abort
            await asyncio.sleep(0.05)

    asyncio.run(consumer_goes())
    wait_until(lambda: "cancelled-add" in added_ids, "the request added after its consumer went was not aborted")
    assert async_engine.num_aborted == aborted_before + 1
    wait_until(lambda: not engine.has_unfinished_requests(), "the aborted request still runs")


# -- item 1: a step's masks together ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def byte_served(tmp_path_factory):
    from serve_support import start_server
    from structured_support import save_byte_checkpoint

    model_dir, _ = save_byte_checkpoint(tmp_path_factory.mktemp("step-budget"))
    server, state = start_server(serve_args(model_dir, {}))
    yield server, state
    server.stop()


def test_a_step_whose_masks_together_pass_the_step_budget_fails_its_slowest_alone(byte_served, monkeypatch):
    """n=3 samples, each fill after a sample's first 'taking' 200 ms on the injected clock (under the 250 ms a
    request may): steps with the three together (600 ms) pass the 500 ms a step may; the first of the slowest fails with an
    error naming structured_outputs_step_mask_budget_ms, the other two finish; a bystander is unaffected."""
    from lora_runner.engine.structured.request_grammar import RequestGrammar
    from lora_runner.entrypoints.openai import generation

    server, state = byte_served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
    alone = client.completions.create(model="base", prompt="abc", max_tokens=8, temperature=0).choices[0].text
    now, real_fill = [0.0], RequestGrammar.fill
    monkeypatch.setattr(state.engine.engine.structured, "_clock", lambda: now[0])
    # one by one, each fill timed (a guidance batch is timed as a whole: tests/test_isolation_round3c.py)
    monkeypatch.setattr(state.engine.engine.structured, "parallel_fill", False)

    filled = set()  # the grammars filled once: each sample's first token is free, so every sample has output
    # before any fails (a failure before a stream's first output would be a 400 instead)
    # and no fill costs anything before the server has read the first output and begun the stream: on a loaded
    # host the loop may read late, and outputs not read yet are merged, a failure with them (then a 400)
    begun = threading.Event()
    real_start = generation.start_runs

    async def start_then_signal(*args, **kwargs):
        runs = await real_start(*args, **kwargs)
        begun.set()
        return runs

    monkeypatch.setattr(generation, "start_runs", start_then_signal)

    def costly_fill(self, bitmask, index, eos_allowed=True):
        if id(self) in filled:
            assert begun.wait(WAIT_S), "the stream never began"
            now[0] += 0.2
        filled.add(id(self))
        return real_fill(self, bitmask, index, eos_allowed)

    monkeypatch.setattr(RequestGrammar, "fill", costly_fill)
    body = {"model": "base", "prompt": "x", "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 1, "stream": True,
            "structured_outputs": {"regex": "[ab]{6}"}}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=WAIT_S)
    assert response.status_code == 200, response.text
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    finished = {c["index"]: c["finish_reason"] for e in events for c in e.get("choices", ()) if c["finish_reason"]}
    assert len(errors) == 1 and "structured_outputs_step_mask_budget_ms" in errors[0]["message"], errors
    assert len(finished) == 2 and set(finished.values()) <= {"length", "stop"}, finished
    bystander = client.completions.create(model="base", prompt="abc", max_tokens=8, temperature=0)
    assert bystander.choices[0].text == alone
