"""The HTTP door under a hostile tenant (issue 23 items 5, 8, 9, 10), through the real server.

One server with an operator key (--api-key), two tenants (a: admin with a runtime adapter, b) and
small limits, so each attack is cheap: metrics and server paths (5), one tenant taking every seat
(8), bodies that cost work before the key is checked or before their counts are (9), and
connections that never finish their headers (10). Bystanders get their exact tokens.
"""

import json
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_support import PROMPTS, model_with_chat_template, offline_greedy, serve_args, start_server, token_ids

from lora_runner.entrypoints.openai import prompts as prompts_module

OPERATOR = "operator-key-0000"
A, B = "key-tenant-a-0000", "key-tenant-b-0000"
KEYS = {A: {"name": "a", "adapters": ["r4", "a-runtime"], "base": True, "admin": True},
        B: {"name": "b", "adapters": ["r8-qv"], "base": True}}
MAX_PENDING, SHARE, MAX_PROMPTS, MAX_MESSAGES, MAX_CONNECTIONS = 8, 0.5, 4, 4, 8
BOUND_S = 30  # generous: what a bystander waits at most while an attack runs


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, adapter root, {name: path})."""
    import yaml

    model_dir, _, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("door")
    model = model_with_chat_template(model_dir, work / "model")
    root = work / "root"
    (root / "a").mkdir(parents=True)  # tenant a's own folder of the root (its keys entry's default)
    shutil.copytree(adapters["r16-patterns"][0], root / "a" / "a-dir")
    (root / "a" / "bad-dir").mkdir()
    (root / "a" / "bad-dir" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    keys_file = work / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    paths = {name: path for name, (path, _) in adapters.items()}
    loras = {name: paths[name] for name in ("r4", "r8-qv")}
    server, state = start_server(serve_args(model, loras, extra=[
        "--api-key", OPERATOR, "--tenant-keys", str(keys_file), "--allow-runtime-lora-updating",
        "--adapter-root", str(root), "--max-pending-requests", str(MAX_PENDING), "--max-tenant-share", str(SHARE),
        "--max-prompts-per-request", str(MAX_PROMPTS), "--max-chat-messages", str(MAX_MESSAGES),
        "--max-connections", str(MAX_CONNECTIONS)]))
    yield server, state, model, root, paths
    server.stop()


def _client(served, key):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=key, max_retries=0, timeout=BOUND_S)


def _post(served, path, body, key, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(served[0].base_url + path, json=body, headers=headers, timeout=BOUND_S, **kwargs)


def _greedy(served, prompt, lora, max_tokens):
    return offline_greedy(served[2], [(prompt, lora, None)], max_tokens, served[4])[0]


def _complete_ids(served, key, model, prompt, max_tokens):
    response = _client(served, key).completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                                       temperature=0, logprobs=0)
    return token_ids(served[1].tokenizer, response.choices[0].logprobs.tokens)


# -- 5: what another tenant has is visible ---------------------------------------------------------------

def test_metrics_are_for_the_operator_and_refused_to_tenants(served):
    for key in (A, B):
        refused = httpx.get(served[0].base_url + "/metrics", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["type"] == "permission_error"
        assert "r8-qv" not in refused.text and "lora_runner_" not in refused.text
    answered = httpx.get(served[0].base_url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"})
    assert answered.status_code == 200 and "lora_runner_requests_running" in answered.text


def test_no_response_shows_an_absolute_server_path(served):
    _, _, model, root, paths = served
    secrets = [str(root), model, *paths.values(), str(root.parent)]
    failed = _post(served, "/v1/load_lora_adapter", {"lora_name": "a-runtime", "lora_path": "bad-dir"}, A)
    missing = _post(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "nope"}, OPERATOR)
    assert failed.status_code == missing.status_code == 422, (failed.text, missing.text)
    assert "nope" in missing.json()["error"]["message"]  # it still says which folder
    seen = [failed.text, missing.text]
    loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "a-runtime", "lora_path": "a-dir"}, A)
    assert loaded.status_code == 200, loaded.text
    try:
        for key in (A, OPERATOR):
            listing = httpx.get(served[0].base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
            roots = {card["id"]: card["root"] for card in listing.json()["data"]}
            assert roots["a-runtime"] == "a-dir" and roots["r4"] == "r4" and roots["base"] == "base"
            seen.append(listing.text)
    finally:
        _post(served, "/v1/unload_lora_adapter", {"lora_name": "a-runtime"}, A)
    for text in seen:
        for secret in secrets:
            assert secret not in text and secret.replace("/", "\\/") not in text, text


# -- 8: one tenant takes every seat ---------------------------------------------------------------------

class _GatedEncode:
    """Wraps the engine's encode: prompts containing `marker` wait for `gate` (as a slow tokenization
    would), everything else goes through. Counts calls and says when a gated one started."""

    def __init__(self, encode, marker: str) -> None:
        self.encode, self.marker = encode, marker
        self.gate, self.entered = threading.Event(), threading.Event()
        self.calls = 0
        self.released_by_timeout = False

    def __call__(self, text):
        self.calls += 1
        if self.marker in text:
            self.entered.set()
            self.released_by_timeout = not self.gate.wait(BOUND_S)
        return self.encode(text)


def test_a_flooding_tenant_gets_429_while_another_keeps_exact_tokens(served, monkeypatch):
    state = served[1]
    gated = _GatedEncode(state.engine.encode, "flood")
    monkeypatch.setattr(state.engine, "encode", gated)
    expected = _greedy(served, PROMPTS[1], "r8-qv", 8)
    seats = int(MAX_PENDING * SHARE)
    with ThreadPoolExecutor(1) as pool:  # a holds its whole share: one request, n = seats, being tokenized
        flood = pool.submit(_post, served, "/v1/completions", {"model": "r4", "prompt": "flood the cat",
                                                                 "n": seats, "max_tokens": 4}, A)
        assert gated.entered.wait(BOUND_S)
        try:
            over = _post(served, "/v1/completions", {"model": "r4", "prompt": "hello", "max_tokens": 2}, A)
            bystander = _complete_ids(served, B, "r8-qv", PROMPTS[1], 8)
        finally:
            gated.gate.set()
        assert flood.result().status_code == 200
    assert over.status_code == 429 and over.headers["retry-after"] == "1"
    assert over.json()["error"]["code"] == "tenant_share_exceeded"
    assert f"{seats} of the server's {MAX_PENDING}" in over.json()["error"]["message"]
    assert bystander == expected
    assert not gated.released_by_timeout


# -- 9: work on the event loop ----------------------------------------------------------------------

def _raw_request(served, head: bytes) -> bytes:
    """Send `head` (request line and headers, no body) and return what the server answers."""
    with socket.create_connection(("127.0.0.1", served[0].port), timeout=BOUND_S) as sock:
        sock.sendall(head)
        return sock.recv(65536)


@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key-000000"])
def test_a_keyless_body_is_refused_before_it_is_read(served, monkeypatch, authorization):
    from starlette.requests import Request

    reads = []
    body_of = Request.body

    async def counting_body(self):
        reads.append(self.url.path)
        return await body_of(self)

    monkeypatch.setattr(Request, "body", counting_body)
    auth = f"Authorization: {authorization}\r\n" if authorization else ""
    # the body is declared but never sent: a server that reads it before the key would wait for it
    answer = _raw_request(served, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
                                  f"application/json\r\nContent-Length: {1 << 20}\r\n\r\n".encode())
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    whole = httpx.post(served[0].base_url + "/v1/completions", json={"model": "base", "prompt": [[1]] * 170_000},
                       headers={"Authorization": authorization} if authorization else {}, timeout=BOUND_S)
    assert whole.status_code == 401 and whole.json()["error"]["type"] == "authentication_error"
    assert reads == []


def test_too_many_prompts_or_messages_are_400_before_any_tokenization(served, monkeypatch):
    state = served[1]
    gated = _GatedEncode(state.engine.encode, "never")
    renders = []
    render = prompts_module.chat_token_ids
    monkeypatch.setattr(state.engine, "encode", gated)
    monkeypatch.setattr(prompts_module, "chat_token_ids", lambda *a, **k: renders.append(1) or render(*a, **k))
    many = _post(served, "/v1/completions", {"model": "base", "prompt": ["hello"] * (MAX_PROMPTS + 1)}, A)
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_many_prompts", many.text
    body = '{"model": "base", "max_tokens": 1, "prompt": [' + ",".join(["[1]"] * 262_000) + "]}"
    flood = httpx.post(served[0].base_url + "/v1/completions", content=body, timeout=BOUND_S,
                       headers={"Authorization": f"Bearer {A}", "Content-Type": "application/json"})
    assert flood.status_code == 400 and flood.json()["error"]["code"] == "too_many_prompts", flood.text
    seats = _post(served, "/v1/completions", {"model": "base", "prompt": ["hello"] * 2, "n": 8}, A)
    assert seats.status_code == 429, seats.text  # 16 sequences: over a's share, refused before tokenizing
    chat = _post(served, "/v1/chat/completions", {"model": "base", "messages": [
        {"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)}, A)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "too_many_messages", chat.text
    assert gated.calls == 0 and renders == []
    assert _post(served, "/v1/completions", {"model": "base", "prompt": ["hello"] * MAX_PROMPTS,
                                             "max_tokens": 1}, A).status_code == 200


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_a_bystander_stream_keeps_producing_while_a_big_body_is_prepared(served, monkeypatch, route):
    state = served[1]
    gated = _GatedEncode(state.engine.encode, "flood")
    monkeypatch.setattr(state.engine, "encode", gated)
    render = prompts_module.chat_token_ids

    def gated_render(tokenizer, conversations, **kwargs):  # kwargs: the request's tools
        if "flood" in json.dumps(conversations):
            gated.entered.set()
            gated.released_by_timeout = not gated.gate.wait(BOUND_S)
        return render(tokenizer, conversations, **kwargs)

    monkeypatch.setattr(prompts_module, "chat_token_ids", gated_render)
    expected = _greedy(served, PROMPTS[2], "r8-qv", 24)
    big = ({"model": "base", "prompt": ["flood " + "cat " * 40_000], "max_tokens": 1} if route == "completions"
           else {"model": "base", "messages": [{"role": "user", "content": "flood " + "cat " * 40_000}],
                 "max_tokens": 1})
    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    chunks = _client(served, B).completions.create(model="r8-qv", prompt=PROMPTS[2], max_tokens=24, temperature=0,
                                                   logprobs=0, stream=True)
    tokens = list(next(iter(chunks)).choices[0].logprobs.tokens)
    with ThreadPoolExecutor(1) as pool:
        heavy = pool.submit(_post, served, path, big, A)
        try:
            assert gated.entered.wait(BOUND_S)
            tokens += [t for chunk in chunks for t in chunk.choices[0].logprobs.tokens]  # while it is prepared
        finally:
            gated.gate.set()
        assert heavy.result().status_code == 400  # far over --max-prompt-tokens, found after tokenizing
    assert token_ids(state.tokenizer, tokens) == expected
    assert not gated.released_by_timeout, "the bystander stream did not finish while the big body was prepared"


# -- 10: connections --------------------------------------------------------------------------------

def _half_open(served, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", served[0].port), timeout=BOUND_S)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")  # and never the rest
        socks.append(sock)
    return socks


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, TimeoutError, socket.timeout):
        return False


async def _hello_app(scope, receive, send):
    """A minimal ASGI app: the header timeout lives in the connection, below any app."""
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"hello"})


def test_a_connection_that_never_finishes_its_headers_is_closed():
    from lora_runner.entrypoints.openai.background import BackgroundServer
    from lora_runner.entrypoints.openai.connections import ConnectionLimits

    slow_headers = ConnectionLimits(max_connections=4, header_timeout=0.5)
    big_headers = ConnectionLimits(max_connections=4, header_timeout=600, max_header_bytes=1024)
    for limits, start in ((slow_headers, b""), (big_headers, b"X-Pad: " + b"p" * 4096)):
        with BackgroundServer(_hello_app, limits=limits) as server:
            with socket.create_connection(("127.0.0.1", server.port), timeout=BOUND_S) as sock:
                sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n" + start)  # and never the rest
                assert _closed_by_server(sock)  # recv waits at most BOUND_S
            assert httpx.get(server.base_url + "/").text == "hello"  # complete requests are served


def test_half_open_connections_do_not_keep_a_new_client_out(served):
    expected = _greedy(served, PROMPTS[1], "r8-qv", 4)
    socks = _half_open(served, MAX_CONNECTIONS + 4)
    try:
        assert _complete_ids(served, B, "r8-qv", PROMPTS[1], 4) == expected
        for sock in socks:
            sock.settimeout(0.5)
        # the server keeps about MAX_CONNECTIONS (the new client's among them): the oldest of these made room
        dropped = sum(_closed_by_server(sock) for sock in socks)
        assert dropped >= len(socks) - MAX_CONNECTIONS, dropped
    finally:
        for sock in socks:
            sock.close()
