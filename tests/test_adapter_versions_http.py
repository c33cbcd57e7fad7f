"""Adapters that change every training step (issue 36), over HTTP: load_inplace of a retrained
folder, uploads of new versions (POST /v1/lora_adapters/{name}/versions), hostile uploads, and the
version every response names (its "adapter" field and the X-Adapter-Version header)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
import yaml
from peft import get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes
from serve_support import offline_greedy, serve_args, start_server, token_ids

from tests import factories

SUPER = "versions-operator-key"
KEYS = {  # acme owns its policy; beta may name it (and is an admin) but does not own it
    "key-acme-000000": {"name": "acme", "adapters": ["acme-policy", "acme-pushed"], "admin": True},
    "key-beta-000000": {"name": "beta", "adapters": ["acme-policy", "beta-policy"], "admin": True},
}
ACME, BETA = list(KEYS)
PROMPT = " ".join(["the cat sat on the mat"] * 8)  # several full KV blocks: a reused version would hit them
LORA = dict(r=4, lora_alpha=8, scale=0.15)
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, base model, adapter root)."""
    model_dir, hf, _ = engine_checkpoint
    work = tmp_path_factory.mktemp("versions-http")
    root = work / "root"
    (root / "acme").mkdir(parents=True)
    keys_file = work / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    server, state = start_server(serve_args(model_dir, {}, extra=[
        "--api-key", SUPER, "--tenant-keys", str(keys_file), "--allow-runtime-lora-updating",
        "--adapter-root", str(root)]))
    yield server, state, model_dir, hf, root
    server.stop()


def _post(served, path: str, key: str, **kwargs) -> httpx.Response:
    return httpx.post(served[0].base_url + path, headers={"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})},
                      timeout=60, **kwargs)


def _complete(served, model: str, key: str, stream: bool = False) -> tuple[list[int], dict, httpx.Response]:
    """(greedy token ids, the response body's "adapter" and usage, the response)."""
    body = dict(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, stream=stream)
    response = _post(served, "/v1/completions", key, json=body)
    assert response.status_code == 200, response.text
    if not stream:
        data = response.json()
        return token_ids(served[1].tokenizer, data["choices"][0]["logprobs"]["tokens"]), data, response
    chunks = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    return token_ids(served[1].tokenizer, tokens), chunks[0], response


def _oracle(served, folder) -> list[int]:
    return offline_greedy(served[2], [(PROMPT, "x", None)], MAX_TOKENS, {"x": str(folder)})[0]


def _upload(served, name: str, key: str, state: dict, config: dict, **headers) -> httpx.Response:
    return _post(served, f"/v1/lora_adapters/{name}/versions", key, content=safetensors_bytes(state),
                 headers={"Content-Type": "application/octet-stream", "X-Adapter-Config": json.dumps(config),
                          **headers})


def _peft(policy) -> tuple[dict, dict]:
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(policy).items()}
    return state, json.loads(json.dumps(policy.peft_config["default"].to_dict(), default=lambda v: sorted(v)
                                        if isinstance(v, set) else str(v)))


def test_load_inplace_of_a_retrained_folder_serves_a_new_version_without_old_cache_hits(served):
    _, _, _, hf, root = served
    folder = root / "acme" / "policy"
    factories.save_lora(hf, folder, seed=41, **LORA)
    load = dict(lora_name="acme-policy", lora_path="policy")
    assert _post(served, "/v1/load_lora_adapter", ACME, json=load).status_code == 200
    want = _oracle(served, folder)
    for _ in range(2):  # the second answer hits the prefix cache: caching is live for one version
        tokens, body, response = _complete(served, "acme-policy", ACME)
        assert tokens == want
    version = body["adapter"]["version"]
    assert body["adapter"]["name"] == "acme-policy" and response.headers["x-adapter-version"] == str(version)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for seed in (42, 43):  # retrain into the same folder, reload in place
        factories.save_lora(hf, folder, seed=seed, **LORA)
        assert _post(served, "/v1/load_lora_adapter", ACME, json={**load, "load_inplace": True}).status_code == 200
        tokens, body, response = _complete(served, "acme-policy", ACME)
        assert tokens == _oracle(served, folder) and tokens != want
        assert body["adapter"]["version"] > version
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        version, want = body["adapter"]["version"], tokens


def test_an_upload_serves_its_weights_as_a_new_version_and_streams_name_it(served, tmp_path):
    _, _, _, hf, root = served
    factories.save_lora(hf, root / "acme" / "pushed", seed=44, **LORA)
    assert _post(served, "/v1/load_lora_adapter", ACME, json=dict(lora_name="acme-pushed",
                                                                   lora_path="pushed")).status_code == 200
    _, before, _ = _complete(served, "acme-pushed", ACME)
    policy = factories.save_lora(hf, tmp_path / "trained", seed=45, **LORA)  # the folder only for the oracle
    response = _upload(served, "acme-pushed", ACME, *_peft(policy))
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["name"] == "acme-pushed" and answer["version"] > before["adapter"]["version"]
    tokens, chunk, stream = _complete(served, "acme-pushed", ACME, stream=True)
    assert tokens == _oracle(served, tmp_path / "trained")
    assert chunk["adapter"] == {"name": "acme-pushed", "version": answer["version"]}
    assert stream.headers["x-adapter-version"] == str(answer["version"])


def _hostile(served, policy) -> dict:
    """what -> (key, state dict, config, expected status) of uploads that must not change what serves."""
    state, config = _peft(policy)
    key = next(k for k in state if k.endswith("lora_A.weight"))
    over_rank = {k: torch.zeros(32, v.shape[1]) if k.endswith("lora_A.weight") else torch.zeros(v.shape[0], 32)
                 for k, v in state.items()}
    limit = served[1].engine.max_adapter_bytes()
    return {
        "wrong shape": (ACME, {**state, key: state[key].t().contiguous()}, config, 422),
        "NaN": (ACME, {**state, key: state[key] * float("nan")}, config, 422),
        "over max_lora_rank": (ACME, over_rank, {**config, "r": 32}, 422),
        "over max_adapter_bytes": (ACME, {**state, "pad": torch.zeros(limit // 4 + 1)}, config, 413),
        "another tenant's adapter": (BETA, state, config, 403),
        "a name the key may not use": (BETA, state, config, 403),
    }


def test_hostile_uploads_are_refused_and_the_current_version_keeps_serving(served, tmp_path):
    _, _, _, hf, root = served
    factories.save_lora(hf, root / "acme" / "policy", seed=46, **LORA)
    load = dict(lora_name="acme-policy", lora_path="policy", load_inplace=True)
    assert _post(served, "/v1/load_lora_adapter", ACME, json=load).status_code == 200
    want, body, _ = _complete(served, "acme-policy", ACME)
    policy = factories.save_lora(hf, tmp_path / "other", seed=47, **LORA)
    for what, (key, state, config, status) in _hostile(served, policy).items():
        name = "acme-pushed" if what == "a name the key may not use" else "acme-policy"
        response = _upload(served, name, key, state, config)
        assert response.status_code == status, (what, response.text)
        tokens, after, _ = _complete(served, "acme-policy", ACME)
        assert tokens == want and after["adapter"] == body["adapter"], what
    state, config = _peft(policy)
    assert _post(served, "/v1/lora_adapters/acme-policy/versions", ACME, content=b"not safetensors",
                 headers={"X-Adapter-Config": json.dumps(config)}).status_code == 422
    assert _post(served, "/v1/lora_adapters/acme-policy/versions", ACME,
                 content=safetensors_bytes(state)).status_code == 400  # no config header
    assert _complete(served, "acme-policy", ACME)[1]["adapter"] == body["adapter"]
