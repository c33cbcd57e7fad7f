"""Runtime loads by absolute path inside --allowed-adapter-paths (same hostile-file rules as the
tenant roots) and vLLM's load_inplace (replace a served LoRA; the old version serves until the new
one has loaded, a failed new one leaves the old serving)."""

from __future__ import annotations

import os
import shutil

import httpx
import openai
import pytest
from serve_support import offline_greedy, serve_args, start_server, token_ids

from lora_runner.entrypoints.openai.state import ServerConfig

KEY = "ops-admin-key-0000"
PROMPT = "the cat sat on the mat"


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, allowed dir, outside dir, {name: adapter path})."""
    model_dir, _, adapters = engine_checkpoint
    work = tmp_path_factory.mktemp("ops-loads")
    root, allowed, outside = work / "root", work / "allowed", work / "outside"
    for folder in (root, allowed, outside):
        folder.mkdir()
    paths = {name: path for name, (path, _) in adapters.items()}
    shutil.copytree(paths["r8-rslora"], allowed / "tenant" / "v1")
    shutil.copytree(paths["r16-mlp"], allowed / "tenant" / "v2")
    shutil.copytree(paths["r4"], outside / "secret")
    (allowed / "tenant" / "broken").mkdir()
    (allowed / "tenant" / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    os.symlink(outside / "secret", allowed / "link-out")
    (work / "allowed-twin").mkdir()  # shares the allowed dir's name as a prefix
    shutil.copytree(paths["r4"], work / "allowed-twin" / "x")
    server, state = start_server(serve_args(model_dir, {}, extra=[
        "--api-key", KEY, "--allow-runtime-lora-updating", "--adapter-root", str(root),
        "--allowed-adapter-paths", str(allowed)]))
    yield server, state, model_dir, allowed, outside, paths
    server.stop()


def _load(served, name: str, path: str, **extra) -> httpx.Response:
    return httpx.post(served[0].base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path,
                      **extra}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def _greedy(served, model: str) -> list[int]:
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=KEY, max_retries=0)
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       logprobs=0).choices[0]
    return token_ids(served[1].tokenizer, choice.logprobs.tokens)


def _oracle(served, path: str) -> list[int]:
    return offline_greedy(served[2], [(PROMPT, "x", None)], 6, {"x": path})[0]


def _served_names(served) -> set[str]:
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=KEY, max_retries=0)
    return {model.id for model in client.models.list().data}


def test_an_absolute_path_inside_an_allowed_dir_loads_and_serves_its_weights(served):
    path = str(served[3] / "tenant" / "v1")
    response = _load(served, "abs-v1", path)
    assert response.status_code == 200, response.text
    assert "abs-v1" in _served_names(served)
    assert _greedy(served, "abs-v1") == _oracle(served, path)


@pytest.mark.parametrize("where", ["outside", "dotdot", "symlink", "twin", "allowed-itself", "dot"])
def test_absolute_paths_outside_the_allow_list_are_403_before_any_read(served, where):
    allowed, outside = served[3], served[4]
    path = {"outside": str(outside / "secret"), "dotdot": f"{allowed}/tenant/../../outside/secret",
            "symlink": str(allowed / "link-out"), "twin": f"{allowed}-twin/x", "allowed-itself": str(allowed),
            "dot": f"{allowed}/./tenant/v1"}[where]
    response = _load(served, f"esc-{where}", path)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["type"] == "permission_error"
    assert f"esc-{where}" not in _served_names(served) and f"esc-{where}" not in served[1].engine.list_loras()


def test_a_missing_dir_inside_the_allow_list_is_422_naming_no_server_path(served):
    response = _load(served, "abs-missing", str(served[3] / "tenant" / "nope"))
    assert response.status_code == 422, response.text
    assert str(served[3]) not in response.text


def test_load_inplace_replaces_the_adapter_and_a_failed_replacement_leaves_the_old_one(served):
    v1, v2, broken = (str(served[3] / "tenant" / name) for name in ("v1", "v2", "broken"))
    assert _load(served, "swap", v1).status_code == 200
    before = _greedy(served, "swap")
    taken = _load(served, "swap", v2)
    assert taken.status_code == 400 and "load_inplace" in taken.text
    assert _greedy(served, "swap") == before
    failed = _load(served, "swap", broken, load_inplace=True)
    assert failed.status_code == 422, failed.text
    assert _greedy(served, "swap") == before  # the old version serves on
    replaced = _load(served, "swap", v2, load_inplace=True)
    assert replaced.status_code == 200 and "replaced" in replaced.text
    after = _greedy(served, "swap")
    assert after == _oracle(served, v2) and after != before


def test_load_inplace_of_a_new_name_loads_it(served):
    assert _load(served, "fresh", str(served[3] / "tenant" / "v2"), load_inplace=True).status_code == 200
    assert "fresh" in _served_names(served)


@pytest.mark.parametrize("bad", ["relative/dir", "/no/such/dir"])
def test_allowed_adapter_paths_must_be_existing_absolute_dirs(bad):
    with pytest.raises(ValueError, match="allowed adapter path"):
        ServerConfig(served_model_name="base", allowed_adapter_paths=(bad,))
