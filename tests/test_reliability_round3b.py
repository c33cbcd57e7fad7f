"""Round three of hostile tenants, second part (issue 39 items 11, 6, 12).

Item 11: a quantized checkpoint whose scales hold NaN or inf is refused when it loads, naming the
tensor (before, it started and every completion failed as "non-finite logits"), in each format
whose scales the loader reads (GPTQ, AWQ, compressed-tensors int4 and fp8). A served LoRA whose
finite but huge weights overflow the activations fails its own requests with 422 naming it in the
OpenAI error shape (before, 500 "internal server error"), streamed or not; a bystander LoRA's greedy
tokens stay exact.

Item 6: a response's logprob entries are counted before the request runs (prompts x n x (max_tokens
plus echoed prompt) x (k+1), vLLM's prompt_logprobs per choice): over --max-logprob-entries is a 400
and the engine never sees it; an lm-eval-style echo scoring request under the limit answers as before.

Item 12: streams whose client never reads give their admission seats back once the engine has finished
them (before, they held them until the send timeout), their unsent output charged to
--max-unsent-bytes; a budget too small keeps the seats taken. Counted through the server's state.
"""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_runner.model import load_model

from factories import save_tiny_model
from quant_support import save_ct_fp8, save_ct_w4a16
from test_quant_int4_formats import write_int4_checkpoint

LAYER = "model.layers.1.self_attn.k_proj"
MAX_ENTRIES = 20_000  # the served fixture's --max-logprob-entries


def _poison(path, tensor: str, value: float) -> None:
    """Set one element of checkpoint tensor `tensor` in path/model.safetensors to `value`."""
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    poisoned = tensors[tensor].clone()
    poisoned.view(-1)[poisoned.numel() // 2] = value
    tensors[tensor] = poisoned
    save_file(tensors, str(file), metadata={"format": "pt"})


def _write(kind: str, path):
    """A tiny checkpoint of quantization `kind` at `path`; returns the name of LAYER's scales tensor."""
    if kind in ("gptq", "awq"):
        hf = save_tiny_model(path / "float", "llama", seed=3)
        write_int4_checkpoint(hf, path / "model", kind, group_size=32)
        return f"{LAYER}.scales"
    if kind == "ct-int4":
        save_ct_w4a16(path / "model")
    else:
        save_ct_fp8(path / "model")
    return f"{LAYER}.weight_scale"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kind", ["gptq", "awq", "ct-int4", "fp8"])
def test_a_checkpoint_with_non_finite_scales_is_refused_naming_the_tensor(tmp_path, kind, value):
    tensor = _write(kind, tmp_path)
    load_model(str(tmp_path / "model"))  # the untouched checkpoint loads
    _poison(tmp_path / "model", tensor, value)
    with pytest.raises(ValueError, match=re.escape(tensor) + ".*(NaN|non-finite)"):
        load_model(str(tmp_path / "model"))


# -- 11: a tenant's adapter that overflows fails its own requests, named, never as a 5xx ---------------------

@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, {lora name: path}) with a bystander LoRA and one whose logits overflow."""
    from factories import save_huge_lora
    from serve_support import model_with_chat_template, serve_args, start_server

    checkpoint, hf, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("round3b")
    model_dir = model_with_chat_template(checkpoint, work / "model")
    save_huge_lora(hf, work / "huge")
    loras = {"r8-qv": adapters["r8-qv"][0], "huge": str(work / "huge")}
    server, state = start_server(serve_args(model_dir, loras, extra=["--max-logprob-entries", str(MAX_ENTRIES)]))
    yield server, state, model_dir, loras
    server.stop()


def _bystander_is_exact(served) -> None:
    """A greedy completion on the bystander LoRA equals LLM.generate's tokens."""
    import openai
    from serve_support import PROMPTS, offline_greedy, token_ids

    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    response = client.completions.create(model="r8-qv", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0)
    got = token_ids(served[1].tokenizer, response.choices[0].logprobs.tokens)
    assert got == offline_greedy(served[2], [(PROMPTS[0], "r8-qv", None)], 6, served[3])[0]


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "the cat sat", "max_tokens": 4}),
    ("/v1/completions", {"prompt": ["the cat sat", "hello world"], "max_tokens": 4, "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
])
def test_an_adapter_whose_logits_overflow_is_named_in_a_4xx(served, route, body):
    import httpx

    response = httpx.post(served[0].base_url + route, json={"model": "huge", **body}, timeout=60)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == "non_finite_logits", error
    assert "`huge`" in error["message"] and "NaN or infinite" in error["message"], error
    _bystander_is_exact(served)


# -- 6: a response's logprob entries are bounded before the request runs -------------------------------------

def _counting_engine_calls(served, monkeypatch) -> list:
    """The engine requests the server starts from now on (their prompts)."""
    engine, calls = served[1].engine, []
    generate = engine.generate

    def counted(prompt, *args, **kwargs):
        calls.append(prompt)
        return generate(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "generate", counted)
    return calls


LONG_PROMPT = "the cat sat on the mat and the dog said yes " * 6  # 66 tokens


@pytest.mark.parametrize("body", [
    # the shape scaled down: 16 prompts x 66 tokens, n=16, prompt_logprobs=20 (about 320k entries)
    {"prompt": [LONG_PROMPT] * 16, "n": 16, "max_tokens": 2, "prompt_logprobs": 20},
    # each factor alone is legal; n multiplies the echoed prompt (16 x 66 x 21 > 20000)
    {"prompt": LONG_PROMPT, "n": 16, "max_tokens": 0, "echo": True, "logprobs": 20},
    {"prompt": "hello world", "n": 16, "max_tokens": 100, "logprobs": 20},
])
def test_a_response_over_the_logprob_entry_limit_is_refused_before_it_runs(served, monkeypatch, body):
    import httpx

    calls = _counting_engine_calls(served, monkeypatch)
    response = httpx.post(served[0].base_url + "/v1/completions", json={"model": "r8-qv", **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "too_many_logprobs" and str(MAX_ENTRIES) in error["message"], error
    assert calls == []  # refused before any engine work
    _bystander_is_exact(served)


def test_lm_eval_style_echo_scoring_under_the_limit_answers_exactly(served, monkeypatch):
    """loglikelihood requests (echo, max_tokens=0, logprobs=1) over several prompts: each choice is its
    prompt echoed with one entry per prompt token, the first null, the rest LLM.generate's prompt logprobs."""
    import httpx
    from serve_support import PROMPTS

    from lora_runner import LLM, SamplingParams

    calls = _counting_engine_calls(served, monkeypatch)
    body = {"model": "base", "prompt": PROMPTS[:4] + [LONG_PROMPT], "max_tokens": 0, "echo": True, "logprobs": 1}
    response = httpx.post(served[0].base_url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(calls) == 5
    tokenizer = served[1].tokenizer
    prompts = [tokenizer.encode(prompt) for prompt in body["prompt"]]
    llm = LLM(served[2], device="cpu", dtype="float32", max_model_len=512)
    try:
        wanted = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0), use_tqdm=False)
    finally:
        llm.close()
    for prompt, ids, want, choice in zip(body["prompt"], prompts, wanted, response.json()["choices"]):
        assert choice["text"] == prompt
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        assert got[1:] == pytest.approx([want.prompt_logprobs[j][ids[j]] for j in range(1, len(ids))], abs=1e-5)


# -- 12: a finished response its client does not read gives its seats back, within a byte budget --------------


@pytest.mark.parametrize("max_unsent", [64 << 20, 1])
def test_unread_finished_streams_free_their_seats_within_the_unsent_budget(engine_checkpoint, tmp_path, max_unsent):
    """Two n=16 streams with logprobs whose client never reads: once the engine has finished them their
    32 seats are free and what they hold unsent is charged to --max-unsent-bytes; a budget too small
    for them keeps the seats taken (the old bound) until the connections go. A bystander stays exact."""
    import socket

    from serve_support import model_with_chat_template, serve_args, serve_configs, wait_until
    from test_reliability_stream import _stalled_stream

    from lora_runner.entrypoints.launch import build_state
    from lora_runner.entrypoints.openai.app import build_app
    from lora_runner.entrypoints.openai.background import BackgroundServer

    model_dir = model_with_chat_template(engine_checkpoint[0], tmp_path / "model")
    loras = {"r8-qv": engine_checkpoint[2]["r8-qv"][0]}
    state = build_state(*serve_configs(serve_args(model_dir, loras, extra=[
        "--stream-send-timeout", "600", "--max-unsent-bytes", str(max_unsent)])))
    server = BackgroundServer(build_app(state))
    server._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 10)  # the stalled clients block a send
    server.start()
    try:
        body = {"model": "base", "prompt": "the cat sat on the mat", "n": 16, "max_tokens": 120, "ignore_eos": True,
                "logprobs": 5, "temperature": 1.0, "seed": 3, "stream": True}
        socks = [_stalled_stream(server.port, body), _stalled_stream(server.port, body)]
        engine = state.engine
        wait_until(lambda: engine.num_in_flight() == 2, "the stalled streams started")
        wait_until(lambda: (engine.get_stats().running, engine.get_stats().waiting) == (0, 0)
               and engine.engine.has_unfinished_requests() is False, "the engine finished both")
        assert engine.num_in_flight() == 2  # their outputs wait unread in the collectors
        if max_unsent > 1:
            wait_until(lambda: state.in_flight == 0, "the finished streams kept their seats")
            assert 0 < state.unsent_bytes <= max_unsent
        else:
            assert state.in_flight == 32 and state.unsent_bytes == 0  # over the budget: seats kept
        _bystander_is_exact((server, state, model_dir, loras))
        for sock in socks:
            sock.close()
        wait_until(lambda: state.in_flight == 0 and state.unsent_bytes == 0, "a closed connection kept its share")
    finally:
        server.stop()


def test_a_response_that_ends_before_the_engine_reports_done_charges_nothing():
    """The engine's "done" reaches the loop after the consumer read the last output and the response
    ended: nothing is charged then (a charge no end() would ever refund), and the seats went back once."""
    from types import SimpleNamespace

    from lora_runner.entrypoints.openai.generation import _SeatsBackWhenDone
    from lora_runner.entrypoints.openai.state import ServerState

    callbacks, released = {}, []
    state = SimpleNamespace(config=SimpleNamespace(max_unsent_bytes=1000), unsent_bytes=0,
                            engine=SimpleNamespace(when_finished=callbacks.__setitem__))
    state.hold_unsent = lambda nbytes: ServerState.hold_unsent(state, nbytes)
    runs = [SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")]
    seats = _SeatsBackWhenDone(state, runs, lambda: released.append(1))
    callbacks["a"](300)
    assert released == [] and state.unsent_bytes == 0  # b is still running
    callbacks["b"](200)
    assert released == [1] and state.unsent_bytes == 500
    seats.end()
    assert state.unsent_bytes == 0

    late = _SeatsBackWhenDone(state, runs, lambda: released.append(2))
    late.end()  # the response ended first
    callbacks["a"](300)
    callbacks["b"](200)
    assert state.unsent_bytes == 0 and released == [1]


def test_chat_prompt_logprobs_are_counted_once_as_they_are_returned_once(served, monkeypatch):
    """Chat returns prompt_logprobs once on the response, whatever n: 16 x 66 x 21 entries would be over
    the limit, 66 x 21 are not, and the request answers with one field of the prompt's length."""
    import httpx

    calls = _counting_engine_calls(served, monkeypatch)
    body = {"model": "base", "messages": [{"role": "user", "content": LONG_PROMPT}], "n": 16, "max_tokens": 2,
            "prompt_logprobs": 20}
    response = httpx.post(served[0].base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(calls) == 1 and len(response.json()["prompt_logprobs"]) == len(calls[0]) > 66
    assert len(response.json()["choices"]) == 16
