"""The HTTP door, round three (issue 39 items 7, 8, 9, 12), through the real server.

One server with an operator key and two tenants: bodies whose bytes decode to something the server
cannot carry (a lone UTF-16 surrogate, nesting deeper than any parser should recurse) are 400 in
the OpenAI error shape, never a 5xx (7); a request with two Authorization headers is refused,
whichever comes first (8); two keys may not name one tenant (9, at start); a soft prompt's virtual
tokens count against the context like prompt tokens (12). A bystander's exact tokens after each
attack show the server kept serving.
"""

import httpx
import openai
import pytest
from serve_support import PROMPTS, model_with_chat_template, offline_greedy, serve_args, start_server, token_ids

OPERATOR = "operator-key-0000"
A, B = "key-tenant-a-0000", "key-tenant-b-0000"
KEYS = {A: {"name": "a", "adapters": ["r4", "soft"], "base": True},
        B: {"name": "b", "adapters": ["r8-qv"], "base": True}}
NUM_VIRTUAL, MAX_MODEL_LEN = 8, 512
BOUND_S = 60


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, {lora name: path}, {soft prompt name: path})."""
    import yaml
    from factories import save_prompt_adapter

    model_dir, hf, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("round3")
    model = model_with_chat_template(model_dir, work / "model")
    save_prompt_adapter(hf, work / "soft", num_virtual_tokens=NUM_VIRTUAL, seed=7)
    keys_file = work / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    loras = {name: adapters[name][0] for name in ("r4", "r8-qv")}
    softs = {"soft": str(work / "soft")}
    server, state = start_server(serve_args(model, loras, softs, extra=[
        "--api-key", OPERATOR, "--tenant-keys", str(keys_file)]))
    yield server, state, model, loras, softs
    server.stop()


def _raw(served, path: str, body: bytes, headers: list[tuple[str, str]]) -> httpx.Response:
    return httpx.post(served[0].base_url + path, content=body, headers=[("Content-Type", "application/json"),
                                                                       *headers], timeout=BOUND_S)


def _assert_openai_400(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["type"] == "invalid_request_error", error
    return error


def _bystander_is_exact(served):
    """Tenant b's greedy completion equals LLM.generate's tokens (the server still serves)."""
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=B, max_retries=0, timeout=BOUND_S)
    response = client.completions.create(model="r8-qv", prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=0)
    got = token_ids(served[1].tokenizer, response.choices[0].logprobs.tokens)
    assert got == offline_greedy(served[2], [(PROMPTS[0], "r8-qv", None)], 6, served[3])[0]


# -- 7: bytes the server cannot carry are the client's error ------------------------------------------------

SURROGATE = "a\\ud800b"  # JSON text of a lone high surrogate: valid JSON, no valid UTF-8
DEEP = 100_000
BAD_BODIES = {
    "surrogate prompt": ("/v1/completions", '{"model": "base", "prompt": "%s", "max_tokens": 2}' % SURROGATE),
    "surrogate in a prompt list": ("/v1/completions",
                                   '{"model": "base", "prompt": ["ok", "%s"], "max_tokens": 2}' % SURROGATE),
    "low surrogate in stop": ("/v1/completions", '{"model": "base", "prompt": "hi", "stop": ["\\udc00"]}'),
    "surrogate chat content": ("/v1/chat/completions",
                               '{"model": "base", "messages": [{"role": "user", "content": "%s"}]}' % SURROGATE),
    "surrogate in a key": ("/v1/completions", '{"model": "base", "prompt": "hi", "\\ud83d": 1}'),
    "deep prompt": ("/v1/completions", '{"model": "base", "prompt": ' + "[" * DEEP + "]" * DEEP + "}"),
    "deep unknown field": ("/v1/completions", '{"model": "base", "prompt": "hi", "x": ' + '{"a":' * DEEP
                           + "1" + "}" * DEEP + "}"),
    "deep chat content": ("/v1/chat/completions", '{"model": "base", "messages": [{"role": "user", "content": '
                          + "[" * 3000 + "]" * 3000 + "}]}"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_undecodable_or_too_deep_bodies_are_400_in_the_openai_shape(served, case):
    path, body = BAD_BODIES[case]
    _assert_openai_400(_raw(served, path, body.encode(), [("Authorization", f"Bearer {A}")]))


def test_a_valid_surrogate_pair_is_text_and_the_server_keeps_serving(served):
    body = '{"model": "base", "prompt": "hi \\ud83d\\ude00", "max_tokens": 2}'.encode()
    response = _raw(served, "/v1/completions", body, [("Authorization", f"Bearer {A}")])
    assert response.status_code == 200, response.text
    _bystander_is_exact(served)


# -- 8: two Authorization headers are ambiguous ------------------------------------------------------------

@pytest.mark.parametrize("pair", [(A, A), (A, B), (A, "no-such-key-0000"), ("no-such-key-0000", A), (OPERATOR, B)])
def test_two_authorization_headers_are_refused_whatever_their_order(served, pair):
    body = b'{"model": "base", "prompt": "hi", "max_tokens": 2}'
    response = _raw(served, "/v1/completions", body, [("Authorization", f"Bearer {key}") for key in pair])
    assert response.status_code in (400, 401), response.text
    assert set(response.json()["error"]) == {"message", "type", "code"}
    for listing in ("/v1/models", "/metrics"):  # GET routes read the key the same way
        got = httpx.get(served[0].base_url + listing, headers=[("Authorization", f"Bearer {key}") for key in pair])
        assert got.status_code in (400, 401), (listing, got.text)
    one = _raw(served, "/v1/completions", body, [("Authorization", f"Bearer {pair[0]}")])
    assert one.status_code in (200, 401)  # one header: the usual answer for that key


# -- 9: two keys may not share a tenant's name ---------------------------------------------------------------

NAME_CLASHES = {  # keys-file entries -> what the error line names
    "derived equals explicit": ({"key-first-00000": {}, "key-second-0000": {"name": "tenant-0"}}, "tenant-0"),
    "explicit twice": ({"key-first-00000": {"name": "acme"}, "key-second-0000": {"name": "acme"}}, "acme"),
    "explicit equals an --api-key name": ({"key-first-00000": {"name": "api-key-0"}}, "api-key-0"),
}


@pytest.mark.parametrize("case", list(NAME_CLASHES))
def test_keys_naming_one_tenant_twice_are_refused_at_start(tmp_path, case):
    import yaml

    from lora_runner.entrypoints.openai.tenants import KeyRing

    entries, name = NAME_CLASHES[case]
    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump(entries))
    with pytest.raises(ValueError, match=name) as refused:
        KeyRing.from_options(["operator-key-0000"], str(path))
    assert "\n" not in str(refused.value) and "key-first" not in str(refused.value)  # one line, no key


def test_unnamed_entries_get_distinct_names_that_no_explicit_name_takes(tmp_path):
    import yaml

    from lora_runner.entrypoints.openai.tenants import KeyRing, load_tenant_keys

    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"key-first-00000": {}, "key-second-0000": {"name": "b"}, "key-third-00000": {}}))
    tenants = load_tenant_keys(path)
    assert len({tenant.name for tenant in tenants.values()}) == 3
    assert KeyRing.from_options(["operator-key-0000"], str(path)).num_tenants == 4


def test_the_cli_says_the_clash_in_one_line_before_loading_the_model(engine_checkpoint, tmp_path, capsys, monkeypatch):
    import yaml

    from lora_runner.entrypoints.cli import main

    path = tmp_path / "keys.yaml"
    path.write_text(yaml.safe_dump({"key-first-00000": {}, "key-second-0000": {"name": "tenant-0"}}))
    monkeypatch.setattr("lora_runner.entrypoints.launch.LLMEngine", None)  # reaching the model is a failure
    with pytest.raises(SystemExit) as exited:
        main(["serve", engine_checkpoint[0], "--device", "cpu", "--port", "0", "--tenant-keys", str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tenant-0" in err, err


# -- 12: a soft prompt's virtual tokens count against the context ------------------------------------------

def _word_ids(served, count: int) -> list[int]:
    return served[1].tokenizer.encode(" ".join(["cat"] * count), add_special_tokens=False)[:count]


@pytest.mark.parametrize("model_field", [{"model": "soft"}, {"model": "base", "prompt_adapter": "soft"}])
def test_virtual_tokens_count_in_the_context_length_check(served, model_field):
    prompt = _word_ids(served, 500)
    fits = MAX_MODEL_LEN - len(prompt) - NUM_VIRTUAL
    headers = {"Authorization": f"Bearer {A}"}
    over = httpx.post(served[0].base_url + "/v1/completions", headers=headers, timeout=BOUND_S,
                      json={**model_field, "prompt": prompt, "max_tokens": fits + 1})
    error = _assert_openai_400(over)
    assert error["code"] == "context_length_exceeded" and str(NUM_VIRTUAL) in error["message"], error
    ok = httpx.post(served[0].base_url + "/v1/completions", headers=headers, timeout=BOUND_S,
                    json={**model_field, "prompt": prompt, "max_tokens": fits, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == fits  # every token asked for, none cut by the soft prompt


def test_a_chat_without_max_tokens_gets_the_context_left_after_the_virtual_tokens(served):
    response = httpx.post(served[0].base_url + "/v1/chat/completions", headers={"Authorization": f"Bearer {A}"},
                          timeout=BOUND_S, json={"model": "soft", "ignore_eos": True,
                                                 "messages": [{"role": "user", "content": "cat " * 480}]})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] + NUM_VIRTUAL + usage["completion_tokens"] == MAX_MODEL_LEN, usage
