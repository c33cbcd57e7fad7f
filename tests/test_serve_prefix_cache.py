"""Prefix caching over HTTP: usage.prompt_tokens_details.cached_tokens, the tenant salt (two tenants
never share a block), the body's cache_salt (added to the tenant's), the switch for single-tenant
deployments, and the Prometheus counters."""

import httpx
import openai
import pytest
import yaml
from serve_support import serve_args, start_server

KEYS = {"key-tenant-a-0000": {"name": "a", "base": True}, "key-tenant-b-0000": {"name": "b", "base": True}}
A, B = list(KEYS)
OPERATOR = "operator-key-0000"  # /metrics is the operator's
PROMPT = [5 + i for i in range(40)]  # 40 tokens: 2 blocks of 16 may be cached


def _served(engine_checkpoint, tmp_path, extra):
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    return start_server(serve_args(engine_checkpoint[0], {}, extra=["--tenant-keys", str(keys_file), "--api-key", OPERATOR,
                                                                      *extra]))


def _cached(server, key, **extra_body):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    response = client.completions.create(model="base", prompt=PROMPT, max_tokens=2, temperature=0.0,
                                         extra_body=extra_body or None)
    return response.usage.prompt_tokens_details.cached_tokens, response.choices[0].text


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    server, state = _served(engine_checkpoint, tmp_path_factory.mktemp("serve-prefix"), [])
    yield server, state
    server.stop()


def test_tenants_never_share_blocks_and_the_body_salt_adds_to_the_tenants(served):
    server, _ = served
    first, text = _cached(server, A)
    assert first == 0
    assert _cached(server, A) == (32, text)  # the same tenant hits its own blocks
    assert _cached(server, B) == (0, text)  # the same prompt and model, another tenant: no hit
    assert _cached(server, A, cache_salt="conversation-1") == (0, text)
    assert _cached(server, A, cache_salt="conversation-1") == (32, text)
    assert _cached(server, B, cache_salt="conversation-1")[0] == 0  # never replaces the tenant salt
    metrics = httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text
    hits = next(line for line in metrics.splitlines() if line.startswith("lora_runner_prefix_cache_hits_total"))
    queries = next(line for line in metrics.splitlines() if line.startswith("lora_runner_prefix_cache_queries_total"))
    assert float(hits.split()[-1]) == 64 and float(queries.split()[-1]) == 6 * 40
    assert "lora_runner_kv_blocks_cached " in metrics


def test_an_empty_cache_salt_is_refused(served):
    with pytest.raises(openai.BadRequestError):
        _cached(served[0], A, cache_salt="")


def test_without_the_tenant_salt_tenants_share_the_cache(engine_checkpoint, tmp_path):
    server, state = _served(engine_checkpoint, tmp_path, ["--no-prefix-cache-tenant-salt"])
    try:
        assert state.config.prefix_cache_tenant_salt is False
        assert _cached(server, A)[0] == 0
        assert _cached(server, B)[0] == 32
    finally:
        server.stop()
