"""The OpenAI-compatible server on the tiny model, driven by the official openai client.

One server per module (three LoRAs, a soft prompt, a chat template, no keys); outputs are checked
against LLM.generate on the same model dir.
"""

import json

import httpx
import openai
import pytest
from serve_support import PROMPTS, model_with_chat_template, offline_greedy, serve_args, start_server, token_ids

LORAS = ("r4", "r8-rslora", "r16-mlp")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, {lora: path}, {soft prompt: path})."""
    from factories import save_prompt_adapter

    model_dir, hf, adapters = engine_checkpoint
    root = tmp_path_factory.mktemp("serve-api")
    model = model_with_chat_template(model_dir, root / "model")
    soft = {"soft": str(root / "soft")}
    save_prompt_adapter(hf, soft["soft"], num_virtual_tokens=4, seed=11)
    loras = {name: adapters[name][0] for name in LORAS}
    server, state = start_server(serve_args(model, loras, soft))
    yield server, state, model, loras, soft
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(served):
    return served[1].tokenizer


def test_models_lists_base_and_adapters_with_parent(client):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"base", *LORAS, "soft"}
    assert models["base"].model_extra["parent"] is None
    assert all(models[name].model_extra["parent"] == "base" for name in (*LORAS, "soft"))


JOBS = [(prompt, lora, None) for prompt in PROMPTS[:3] for lora in (None, *LORAS)] + \
       [(PROMPTS[3], None, "soft"), (PROMPTS[4], "r4", "soft")]


@pytest.fixture(scope="module")
def offline(served):
    _, _, model, loras, soft = served
    return dict(zip(range(len(JOBS)), offline_greedy(model, JOBS, MAX_TOKENS, loras, soft)))


@pytest.mark.parametrize("job", range(len(JOBS)))
def test_greedy_completion_equals_offline(client, tokenizer, offline, job):
    prompt, lora, soft = JOBS[job]
    extra = {"prompt_adapter": soft} if soft else None
    response = client.completions.create(model=lora or "base", prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0, logprobs=0, extra_body=extra)
    choice = response.choices[0]
    assert token_ids(tokenizer, choice.logprobs.tokens) == offline[job]
    assert choice.text == tokenizer.decode(offline[job], skip_special_tokens=True)
    assert response.usage.completion_tokens == len(offline[job])
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_token_id_prompts_and_several_prompts(client, tokenizer, offline):
    """A list of prompts gives one choice per prompt, in order; token-id prompts work like text."""
    jobs = [j for j, (_, lora, soft) in enumerate(JOBS) if lora == "r4" and soft is None]
    prompts = [tokenizer.encode(JOBS[j][0]) for j in jobs]
    response = client.completions.create(model="r4", prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    assert [c.index for c in response.choices] == list(range(len(jobs)))
    assert [token_ids(tokenizer, c.logprobs.tokens) for c in response.choices] == [offline[j] for j in jobs]


def test_a_soft_prompt_named_by_model_equals_it_named_by_prompt_adapter(client, tokenizer, offline):
    job = JOBS.index((PROMPTS[3], None, "soft"))
    response = client.completions.create(model="soft", prompt=PROMPTS[3], max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=0)
    assert token_ids(tokenizer, response.choices[0].logprobs.tokens) == offline[job]


def test_several_prompts_stream_interleaved_and_each_choice_adds_up(client):
    kwargs = dict(model="r16-mlp", prompt=PROMPTS[:3], max_tokens=10, temperature=0)
    whole = client.completions.create(**kwargs)
    texts, reasons = {}, {}
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}


@pytest.mark.parametrize("lora", [None, "r8-rslora"])
def test_streaming_deltas_concatenate_to_the_whole_text(client, lora):
    kwargs = dict(model=lora or "base", prompt=PROMPTS[5], max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 2 and all(c.usage is None for c in text_chunks)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_the_text_streamed_or_not(client, stream, include):
    kwargs = dict(model="r4", prompt=PROMPTS[5], max_tokens=12, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    stop = " ".join(whole.split(" ")[2:4])  # spans tokens: the stream must not show its first part
    extra = {"include_stop_str_in_output": include}
    if stream:
        chunks = [c for c in client.completions.create(**kwargs, stop=[stop, "#never#"], stream=True,
                                                       extra_body=extra) if c.choices]
        text, choice = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
    else:
        choice = client.completions.create(**kwargs, stop=[stop, "#never#"], extra_body=extra).choices[0]
        text = choice.text
    cut = whole.index(stop) + (len(stop) if include else 0)
    assert (text, choice.finish_reason, choice.model_extra["stop_reason"]) == (whole[:cut], "stop", stop)


def test_stop_and_min_tokens_in_chat(client):
    kwargs = dict(model="base", messages=[{"role": "user", "content": "the cat"}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    first_word = whole.split(" ")[0]
    stopped = client.chat.completions.create(**kwargs, stop=first_word).choices[0]
    assert (stopped.message.content, stopped.finish_reason) == ("", "stop")
    assert stopped.model_extra["stop_reason"] == first_word
    deferred = client.chat.completions.create(**kwargs, stop=first_word, extra_body={"min_tokens": 10})
    assert deferred.choices[0].message.content.startswith(whole[:len(first_word)])
    assert deferred.usage.completion_tokens == 10


def test_stream_ends_with_done_event(served):
    body = {"model": "r4", "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", served[0].base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)


@pytest.mark.parametrize("k", [0, 1])
def test_completion_logprobs_hold_the_sampled_token_and_offsets_run_over_the_choice(client, k):
    """As OpenAI and vLLM: top_logprobs holds the top k and the sampled token (k + 1 entries when it is
    not among them; logprobs=0: the sampled token alone); streamed text_offset runs over the whole choice."""
    kwargs = dict(model="r4", prompt=PROMPTS[0], max_tokens=12, temperature=1.5, seed=3, logprobs=k)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    for token, logprob, top in zip(whole.tokens, whole.token_logprobs, whole.top_logprobs):
        assert top[token] == pytest.approx(logprob)
        best = max(top.values())
        assert len(top) == (1 if k == 0 else 1 + (logprob < best - 1e-6)), (token, top)
    assert k == 0 or any(len(top) == 2 for top in whole.top_logprobs)  # the hot sampling left the top 1
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for chunk in streamed for t in chunk.tokens] == whole.tokens
    assert [o for chunk in streamed for o in chunk.text_offset] == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(len(whole.tokens))]


def test_chat_goes_through_the_chat_template(served, client, tokenizer):
    _, _, model, loras, _ = served
    messages = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "yes"},
                {"role": "user", "content": "the red cat"}]
    prompt = list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    expected = offline_greedy(model, [(prompt, "r4", None)], MAX_TOKENS, loras)[0]
    response = client.chat.completions.create(model="r4", messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0, logprobs=True, top_logprobs=2)
    choice = response.choices[0]
    assert token_ids(tokenizer, [t.token for t in choice.logprobs.content]) == expected
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6
               for t in choice.logprobs.content)
    assert choice.message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(model="r4", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_chat_without_a_template_is_400(served, client):
    tokenizer = served[1].tokenizer
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="base", messages=[{"role": "user", "content": "hi"}])
    finally:
        tokenizer.chat_template = template


def test_seeded_sampling_is_reproducible_and_equals_offline(served, client, tokenizer):
    from lora_runner import LLM, SamplingParams

    kwargs = dict(model="r16-mlp", prompt=PROMPTS[6], max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, logprobs=0)
    first, second = (client.completions.create(**kwargs) for _ in range(2))
    assert first.choices[0].logprobs.tokens == second.choices[0].logprobs.tokens
    from adapters import LoRARequest

    llm = LLM(served[2], device="cpu", dtype="float32", max_model_len=512, max_loras=2)
    try:
        [offline] = llm.generate(PROMPTS[6], SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10),
                                 lora_request=LoRARequest("r16-mlp", served[3]["r16-mlp"]), use_tqdm=False)
    finally:
        llm.close()
    assert token_ids(tokenizer, first.choices[0].logprobs.tokens) == list(offline.outputs[0].token_ids)


def test_health_and_metrics(served, client):
    base = served[0].base_url
    assert httpx.get(base + "/health").status_code == 200
    client.completions.create(model="r4", prompt=PROMPTS[1], max_tokens=3)
    text = httpx.get(base + "/metrics").text
    for name in ("lora_runner_requests_running", "lora_runner_requests_waiting", "lora_runner_prompt_tokens_total",
                 "lora_runner_generation_tokens_total", "lora_runner_lora_slot_misses_total",
                 "lora_runner_lora_slot_evictions_total", "lora_runner_time_to_first_token_seconds_bucket",
                 "lora_runner_inter_token_latency_seconds_bucket", 'lora_runner_requests_total{model="r4"}',
                 'lora_runner_adapter_events_total{event="lora_disk_loads"}'):
        assert name in text, name


def _post(served, path, body=None, **kwargs):
    return httpx.post(served[0].base_url + path, json=body, timeout=60, **kwargs)


ERRORS = [  # (body changes to a valid completion, status, code)
    ({"model": "no-such-adapter"}, 404, "model_not_found"),
    ({"prompt_adapter": "no-such-soft-prompt"}, 404, "model_not_found"),
    ({"prompt_adapter": "r4"}, 404, "model_not_found"),  # a LoRA is not a soft prompt
    ({"model": "soft", "prompt_adapter": "soft"}, 400, "invalid_value"),
    ({"n": 1000}, 400, "invalid_value"),
    ({"n": 0}, 400, "invalid_request"),
    ({"presence_penalty": 2.5}, 400, "invalid_value"),  # SamplingParams' ValueError
    ({"frequency_penalty": -3}, 400, "invalid_value"),
    ({"repetition_penalty": 0}, 400, "invalid_value"),
    ({"stop": [""]}, 400, "invalid_value"),
    ({"stop": ["x" * 257]}, 400, "invalid_value"),
    ({"min_tokens": 5}, 400, "invalid_value"),  # over max_tokens
    ({"logit_bias": {"5": 101.0}}, 400, "invalid_value"),  # in [-100, 100] (tests/test_vllm_logprobs_bias.py)
    ({"best_of": 3}, 400, "unsupported_parameter"),
    ({"stream_options": {"include_usage": True}}, 400, "invalid_value"),
    ({"logprobs": 21}, 400, "invalid_value"),
    ({"max_tokens": 0}, 400, "invalid_value"),  # only with echo (tests/test_prompt_logprobs_http.py)
    ({"max_tokens": -1}, 400, "invalid_request"),
    ({"max_tokens": 10_000}, 400, "invalid_value"),
    ({"max_tokens": 509}, 400, "context_length_exceeded"),
    ({"prompt": "cat " * 600}, 400, "prompt_too_long"),
    ({"prompt": [5, 9999]}, 400, "invalid_value"),  # outside the vocabulary: the engine's ValueError
    ({"prompt": []}, 400, "invalid_value"),
    ({"prompt": ""}, 400, "invalid_value"),
    ({"temperature": -1}, 400, "invalid_request"),
    ({"top_k": 0}, 400, "invalid_value"),  # SamplingParams' ValueError
    ({"min_p": 1.5}, 400, "invalid_request"),
    ({"max_tokens": "8"}, 400, "invalid_request"),  # strict types
    ({"model": None}, 400, "invalid_request"),
]


@pytest.mark.parametrize("change,status,code", ERRORS, ids=[json.dumps(e[0])[:40] for e in ERRORS])
def test_errors_have_their_status_and_the_openai_shape(served, change, status, code):
    body = {"model": "r4", "prompt": PROMPTS[0], "max_tokens": 4, **change}
    response = _post(served, "/v1/completions", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]


def test_error_statuses_outside_completions(served):
    assert _post(served, "/v1/chat/completions", {"model": "r4", "messages": []}).status_code == 400
    bad_json = httpx.post(served[0].base_url + "/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "error" in bad_json.json()
    unknown = httpx.get(served[0].base_url + "/v1/nothing-here")
    assert unknown.status_code == 404 and unknown.json()["error"]["message"]
    # runtime loading is off on this server: 403 whatever the body
    off = _post(served, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"})
    assert off.status_code == 403 and off.json()["error"]["type"] == "permission_error"


def test_body_over_the_limit_is_413_with_or_without_content_length(served):
    limit = served[1].config.max_body_bytes
    big = json.dumps({"model": "r4", "prompt": "cat " * (limit // 4)}).encode()
    assert httpx.post(served[0].base_url + "/v1/completions", content=big,
                      headers={"content-type": "application/json"}).status_code == 413

    def chunked():
        for start in range(0, len(big), 65536):
            yield big[start:start + 65536]

    response = httpx.post(served[0].base_url + "/v1/completions", content=chunked(),
                          headers={"content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("stream", [False, True])
def test_adapter_that_fails_to_load_is_422_and_others_go_on(served, client, tmp_path, stream):
    from adapters import LoRARequest

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    engine = served[1].engine
    engine.serve_adapter(LoRARequest("broken", str(broken)), load=False)  # served, then its files went bad
    try:
        with pytest.raises(openai.UnprocessableEntityError) as info:
            list(client.completions.create(model="broken", prompt=PROMPTS[0], max_tokens=4, stream=stream)) \
                if stream else client.completions.create(model="broken", prompt=PROMPTS[0], max_tokens=4)
        assert "adapter_config.json" in info.value.body["message"]
        assert client.completions.create(model="r4", prompt=PROMPTS[0], max_tokens=2).choices[0].text
    finally:
        engine.unserve_adapter("broken")


def test_no_capacity_is_503_with_retry_after(served):
    import dataclasses

    from lora_runner.entrypoints.openai.tenants import ANONYMOUS

    state = served[1]
    config = state.config
    state.config = dataclasses.replace(config, max_pending_requests=2)
    release = state.admit(ANONYMOUS, 2)  # two generations in flight
    try:
        busy = _post(served, "/v1/completions", {"model": "r4", "prompt": "hi", "max_tokens": 2})
    finally:
        release()
        state.config = config
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert busy.json()["error"]["code"] == "server_busy"
    assert _post(served, "/v1/completions", {"model": "r4", "prompt": "hi", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_that_disconnects_frees_its_blocks(served, monkeypatch, stream):
    import time

    state = served[1]
    engine = state.engine.engine
    finished = {}
    step = engine.step

    def recording_step():
        time.sleep(0.005)  # >= 2.4 s for the whole request: it cannot finish before the disconnect
        outputs = step()
        finished.update({o.request_id: o for o in outputs if o.finished})
        return outputs

    monkeypatch.setattr(engine, "step", recording_step)
    body = {"model": "r8-rslora", "prompt": PROMPTS[2], "max_tokens": 480, "ignore_eos": True, "stream": stream}
    if stream:
        with httpx.stream("POST", served[0].base_url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(3):
                next(lines)
            assert engine.block_manager.num_used_blocks > 0
    else:  # the client gives up waiting for the whole answer and closes the connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served[0].base_url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 30
    while (not finished or engine.block_manager.num_used_blocks) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_unfinished_requests()
    [output] = finished.values()
    assert output.outputs[0].finish_reason == "abort" and len(output.outputs[0].token_ids) < 480
    assert "lora_runner_kv_blocks_used 0.0" in httpx.get(served[0].base_url + "/metrics").text


# ----------------------------------------------------------------------------- n and penalties
def test_n_with_a_seed_is_reproducible_and_streams_choice_indices(client):
    kwargs = dict(model="r4", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, n=3, logprobs=0)
    first, again = (client.completions.create(**kwargs) for _ in range(2))
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) == 3
    assert first.usage.completion_tokens == 3 * MAX_TOKENS
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[i] for i in range(3)] == texts
    two_prompts = client.completions.create(**{**kwargs, "prompt": [PROMPTS[0], PROMPTS[1]], "n": 2})
    assert [c.index for c in two_prompts.choices] == [0, 1, 2, 3]
    assert [c.text for c in two_prompts.choices[:2]] == texts[:2]  # prompt 0's samples: the same seeds


def test_chat_n_gives_n_choices(client):
    response = client.chat.completions.create(model="base", messages=[{"role": "user", "content": "the cat"}],
                                              max_tokens=4, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1]
    assert response.choices[0].message.content == response.choices[1].message.content  # greedy


def test_penalties_equal_llm_generate(served, client, tokenizer):
    from lora_runner import LLM, SamplingParams

    penalties = dict(presence_penalty=-2.0, frequency_penalty=-1.0, repetition_penalty=1.3)  # negative: repeats
    response = client.completions.create(model="base", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                         logprobs=0, presence_penalty=-2.0, frequency_penalty=-1.0,
                                         extra_body={"repetition_penalty": 1.3})
    llm = LLM(served[2], device="cpu", dtype="float32", max_model_len=512)
    try:
        expected, plain = (llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **kw),
                                        use_tqdm=False)[0].outputs[0].token_ids for kw in (penalties, {}))
    finally:
        llm.close()
    assert token_ids(tokenizer, response.choices[0].logprobs.tokens) == expected != plain


def test_unknown_fields_are_ignored_and_named_in_a_header(served, client):
    """As vLLM: fields the server does not know are ignored (logged, named in X-Ignored-Fields), not a 400;
    the answer is the one without them. The header is bounded however many there are."""
    body = {"model": "r4", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    plain = _post(served, "/v1/completions", body)
    extra = _post(served, "/v1/completions", {**body, "guided_decoding_backend": "x", "priority": 1})
    assert plain.status_code == extra.status_code == 200 and "x-ignored-fields" not in plain.headers
    assert extra.headers["x-ignored-fields"] == "guided_decoding_backend, priority"
    assert extra.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    chat = _post(served, "/v1/chat/completions", {"model": "r4", "max_tokens": 2, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "hi", "weight": 1}]})
    assert chat.status_code == 200 and chat.headers.get("x-ignored-fields") == "messages[0].weight"
    many = _post(served, "/v1/completions", {**body, **{f"f{i}": i for i in range(1000)}})
    assert many.status_code == 200 and many.headers["x-ignored-fields"].endswith(", and 984 more")


def test_strict_request_fields_refuse_unknown_fields():
    from fastapi.exceptions import RequestValidationError

    from lora_runner.entrypoints.openai.bodies import parse_raw_body
    from lora_runner.entrypoints.openai.protocol import CompletionRequest
    from lora_runner.entrypoints.openai.state import ServerConfig

    raw = json.dumps({"model": "base", "prompt": "hi", "priority": 1}).encode()
    body, ignored = parse_raw_body(ServerConfig(served_model_name="base"), raw, CompletionRequest)
    assert ignored == ["priority"] and body.prompt == "hi"
    with pytest.raises(RequestValidationError):
        parse_raw_body(ServerConfig(served_model_name="base", strict_request_fields=True), raw, CompletionRequest)


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    kwargs = dict(model="r4", prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True)
    chunks = list(client.completions.create(**kwargs, stream_options={"include_usage": True,
                                                                      "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    counts = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage is not None and c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in with_choices)
    assert counts == sorted(counts) and counts[-1] == chunks[-1].usage.completion_tokens == 6
    plain = list(client.completions.create(**kwargs, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens == 6


def test_truncate_prompt_tokens_cuts_the_prompt_before_the_length_checks(served):
    body = {"model": "base", "prompt": "cat " * 600, "max_tokens": 2, "temperature": 0}
    assert _post(served, "/v1/completions", body).status_code == 400  # prompt_too_long
    cut = _post(served, "/v1/completions", {**body, "truncate_prompt_tokens": 5})
    assert cut.status_code == 200 and cut.json()["usage"]["prompt_tokens"] == 5
    assert _post(served, "/v1/completions", {**body, "truncate_prompt_tokens": 0}).status_code == 400
