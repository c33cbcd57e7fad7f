"""Keys, tenant confinement and runtime adapter loading (admin keys, --adapter-root)."""

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serve_support import PROMPTS, offline_greedy, serve_args, start_server, token_ids

from lora_runner.entrypoints.openai.tenants import load_tenant_keys

SUPER = "super-key-000000"
KEYS = {  # key -> tenant entry
    "key-tenant-a-0000": {"name": "a", "adapters": ["r4", "a-runtime"], "base": True, "admin": True,
                          "adapter_root": "."},  # a loads from the whole root
    "key-tenant-b-0000": {"name": "b", "adapters": ["r8-qv", "b-runtime"], "admin": True},
    "key-tenant-c-0000": {"name": "c", "adapters": ["r4"], "base": True, "max_concurrent_requests": 1},
}
A, B, C = list(KEYS)


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, adapter root, {name: path} of every engine test adapter)."""
    import yaml

    model_dir, _, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("serve-tenants")
    root, outside = work / "root", work / "outside"
    root.mkdir()
    outside.mkdir()
    shutil.copytree(adapters["r16-patterns"][0], root / "a-dir")
    shutil.copytree(adapters["r8-rslora"][0], outside / "secret")
    os.symlink(outside / "secret", root / "link-out")
    (root / "bad-dir").mkdir()
    (root / "bad-dir" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    keys_file = work / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    paths = {name: path for name, (path, _) in adapters.items()}
    loras = {name: paths[name] for name in ("r4", "r8-qv", "r16-mlp")}
    server, state = start_server(serve_args(model_dir, loras, extra=[
        "--api-key", SUPER, "--tenant-keys", str(keys_file), "--allow-runtime-lora-updating",
        "--adapter-root", str(root)]))
    yield server, state, model_dir, root, paths
    server.stop()


def _client(served, key):
    return openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=key, max_retries=0)


def _post(served, path, body, key):
    return httpx.post(served[0].base_url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def test_tenant_file_reads_as_yaml_or_json_and_refuses_bad_entries(tmp_path):
    (tmp_path / "k.json").write_text(json.dumps(KEYS))
    tenants = load_tenant_keys(tmp_path / "k.json")
    assert tenants[A].adapters == frozenset({"r4", "a-runtime"}) and tenants[A].admin and tenants[A].base
    assert not tenants[B].base and tenants[C].max_concurrent_requests == 1 and not tenants[C].admin
    for bad in ({"short": {"adapters": []}}, {A: {"adapters": ["r4"], "admn": True}}, {A: {"base": "yes"}}, []):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="tenant keys file"):
            load_tenant_keys(tmp_path / "bad.json")


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("GET", "/metrics"),
                                         ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter")])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key-000000", f"Basic {SUPER}", f"Bearer {SUPER}x"])
def test_every_route_but_health_needs_a_key(served, method, path, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    response = httpx.request(method, served[0].base_url + path, headers=headers, json={})
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(served[0].base_url + "/health").status_code == 200


def test_the_openai_client_with_a_wrong_key_gets_401(served):
    with pytest.raises(openai.AuthenticationError):
        _client(served, "nope-nope-nope").models.list()


@pytest.mark.parametrize("key,expected", [(A, {"base", "r4"}), (B, {"r8-qv"}), (C, {"base", "r4"}),
                                          (SUPER, {"base", "r4", "r8-qv", "r16-mlp"})])
def test_each_key_lists_only_its_models(served, key, expected):
    models = _client(served, key).models.list().data
    assert {m.id for m in models} == expected
    assert all(m.model_extra["parent"] == "base" for m in models if m.id != "base")


@pytest.mark.parametrize("key,other", [(A, "r8-qv"), (B, "r4"), (A, "r16-mlp"), (B, "base")])
def test_another_tenants_model_is_the_same_404_as_an_unknown_one(served, key, other):
    def attempt(name):
        response = _post(served, "/v1/completions", {"model": name, "prompt": "hello", "max_tokens": 2}, key)
        return response.status_code, json.dumps(response.json()).replace(name, "NAME")

    assert attempt(other) == attempt("no-such-model") == (404, attempt("no-such-model")[1])
    chat = _post(served, "/v1/chat/completions", {"model": other, "messages": [{"role": "user", "content": "hi"}]}, key)
    assert chat.status_code == 404


def test_tenants_cannot_load_or_unload_each_others_adapters(served):
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "r8-qv"}, A).status_code == 403
    assert _post(served, "/v1/load_lora_adapter", {"lora_name": "b-runtime", "lora_path": "a-dir"}, A).status_code == 403
    assert _post(served, "/v1/load_lora_adapter", {"lora_name": "r4", "lora_path": "a-dir"}, C).status_code == 403
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "r4"}, C).status_code == 403
    response = _client(served, B).completions.create(model="r8-qv", prompt="hello", max_tokens=2)
    assert response.choices[0].finish_reason in ("length", "stop")  # B's adapter is still there


@pytest.mark.parametrize("path", ["../outside/secret", "a-dir/../../outside/secret", "link-out", "~/secret",
                                  "ABSOLUTE", ".", "a-dir/../link-out"])
def test_the_adapter_root_cannot_be_escaped(served, path):
    if path == "ABSOLUTE":
        path = served[4]["r8-rslora"]
    response = _post(served, "/v1/load_lora_adapter", {"lora_name": "escape", "lora_path": path}, SUPER)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["type"] == "permission_error"
    assert "escape" not in {m.id for m in _client(served, SUPER).models.list().data}
    assert "escape" not in served[1].engine.list_loras()


def test_a_load_that_fails_is_422_and_a_taken_name_is_400(served):
    failed = _post(served, "/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "bad-dir"}, SUPER)
    assert failed.status_code == 422 and failed.json()["error"]["code"] == "adapter_load_failed"
    assert "bad" not in {m.id for m in _client(served, SUPER).models.list().data}
    taken = _post(served, "/v1/load_lora_adapter", {"lora_name": "r4", "lora_path": "a-dir"}, SUPER)
    assert taken.status_code == 400
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, SUPER).status_code == 404


def test_a_tenant_over_its_concurrency_limit_gets_429(served):
    state = served[1]
    tenant_c = state.keys.authenticate(f"Bearer {C}")
    release = state.admit(tenant_c, 1)
    try:
        busy = _post(served, "/v1/completions", {"model": "r4", "prompt": "hello", "max_tokens": 2}, C)
        other = _post(served, "/v1/completions", {"model": "r4", "prompt": "hello", "max_tokens": 2}, A)
    finally:
        release()
    assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
    assert other.status_code == 200


def test_runtime_load_use_unload_while_other_streams_run_and_others_fail(served):
    _, state, model_dir, root, paths = served
    tokenizer = state.tokenizer
    streams = [(PROMPTS[i], "r4") for i in range(4)]
    expected_streams = offline_greedy(model_dir, [(p, lora, None) for p, lora in streams], 24, paths)
    [expected_new] = offline_greedy(model_dir, [(PROMPTS[5], "new", None)], 8, {"new": str(root / "a-dir")})
    client = _client(served, A)

    def stream(job):
        chunks = client.completions.create(model=job[1], prompt=job[0], max_tokens=24, temperature=0, logprobs=0,
                                           stream=True)
        return [t for c in chunks for t in c.choices[0].logprobs.tokens]

    with ThreadPoolExecutor(len(streams)) as pool:
        running = [pool.submit(stream, job) for job in streams]
        # other clients' errors meanwhile: a load that fails, a bad request, an escape attempt
        assert _post(served, "/v1/load_lora_adapter", {"lora_name": "a-runtime", "lora_path": "bad-dir"},
                     A).status_code == 422
        assert _post(served, "/v1/completions", {"model": "r4", "prompt": [5, 99999]}, A).status_code == 400
        assert _post(served, "/v1/load_lora_adapter", {"lora_name": "a-runtime", "lora_path": "link-out"},
                     A).status_code == 403
        loaded = _post(served, "/v1/load_lora_adapter", {"lora_name": "a-runtime", "lora_path": "a-dir"}, A)
        assert loaded.status_code == 200, loaded.text
        assert "a-runtime" in {m.id for m in client.models.list().data}
        assert "a-runtime" not in {m.id for m in _client(served, B).models.list().data}
        used = client.completions.create(model="a-runtime", prompt=PROMPTS[5], max_tokens=8, temperature=0, logprobs=0)
        assert token_ids(tokenizer, used.choices[0].logprobs.tokens) == expected_new
        assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "a-runtime"}, A).status_code == 200
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="a-runtime", prompt=PROMPTS[5], max_tokens=2)
        outputs = [token_ids(tokenizer, f.result()) for f in running]
    assert outputs == expected_streams
