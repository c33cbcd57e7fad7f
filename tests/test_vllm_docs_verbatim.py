"""vLLM's documented multi-LoRA serving (docs.vllm.ai, "LoRA Adapters": "Serving LoRA Adapters" and
"Dynamically serving LoRA Adapters"), run as written against the tiny model: the same serve command
line (`vllm serve` -> `lora-runner serve`, the model and adapter paths swapped for the test's), the
same requests through the official openai client and the same load / unload bodies. Where we differ
(an absolute runtime path needs --allowed-adapter-paths) the test adds that flag and says so.
"""

from __future__ import annotations

import argparse
import shutil

import httpx
import openai
import pytest
from serve_support import offline_greedy, start_server

from lora_runner.entrypoints.cli import add_serve_arguments


def _vllm_command_line(*argv: str) -> argparse.Namespace:
    """`lora-runner serve ARGV` parsed exactly as the CLI parses it (no test defaults added)."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """vLLM's command: `vllm serve MODEL --enable-lora --lora-modules sql-lora=PATH`, runtime loading on
    through `export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` (plus our --allowed-adapter-paths: the one
    documented difference)."""
    model, _, adapters = engine_checkpoint
    allowed = tmp_path_factory.mktemp("vllm-docs")
    shutil.copytree(adapters["r8-rslora"][0], allowed / "sql-lora-adapter")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        server, _ = start_server(_vllm_command_line(
            model, "--enable-lora", "--lora-modules", f"sql-lora={adapters['r4'][0]}",
            "--allowed-adapter-paths", str(allowed)))
    yield server, model, adapters, allowed
    server.stop()


def test_the_documented_serve_command_and_completion_call(served):
    server, model, adapters, _ = served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", max_retries=0)
    ids = [card.id for card in client.models.list().data]
    assert "sql-lora" in ids and len(ids) == 2  # the base model's card and the adapter's
    completion = client.completions.create(model="sql-lora", prompt="San Francisco is a", max_tokens=7,
                                           temperature=0)
    want, base = offline_greedy(model, [("San Francisco is a", "sql-lora", None), ("San Francisco is a", None, None)],
                                7, {"sql-lora": adapters["r4"][0]})
    assert want != base  # the adapter changes these tokens: the comparison below can tell it was applied
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 7
    tokens = httpx.post(server.base_url + "/v1/completions", json={
        "model": "sql-lora", "prompt": "San Francisco is a", "max_tokens": 7, "temperature": 0,
        "return_token_ids": True}, timeout=60).json()["choices"][0]["token_ids"]
    assert tokens == want  # the adapter's exact greedy tokens, as LLM.generate gives them


def test_the_documented_dynamic_load_and_unload_bodies(served):
    server, model, _, allowed = served
    path = str(allowed / "sql-lora-adapter")
    loaded = httpx.post(server.base_url + "/v1/load_lora_adapter",
                        json={"lora_name": "sql_adapter", "lora_path": path}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="EMPTY", max_retries=0)
    assert "sql_adapter" in [card.id for card in client.models.list().data]
    out = client.completions.create(model="sql_adapter", prompt="San Francisco is a", max_tokens=5, temperature=0)
    want = offline_greedy(model, [("San Francisco is a", "sql_adapter", None)], 5, {"sql_adapter": path})
    assert out.choices[0].text == _text(model, want[0])
    unloaded = httpx.post(server.base_url + "/v1/unload_lora_adapter", json={"lora_name": "sql_adapter"},
                          timeout=60)
    assert unloaded.status_code == 200, unloaded.text
    assert "sql_adapter" not in [card.id for card in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="sql_adapter", prompt="San Francisco is a", max_tokens=5)


def test_the_documented_json_lora_modules_form(engine_checkpoint):
    """`--lora-modules '{"name": "sql-lora", "path": ..., "base_model_name": ...}'` (vLLM's JSON form)."""
    model, _, adapters = engine_checkpoint
    args = _vllm_command_line(model, "--enable-lora", "--lora-modules",
                              '{"name": "sql-lora", "path": "%s", "base_model_name": "meta-llama/Llama-2-7b"}'
                              % adapters["r4"][0])
    from serve_support import serve_configs

    startup = serve_configs(args)[2]
    assert [(lora.name, lora.path) for lora in startup.loras] == [("sql-lora", adapters["r4"][0])]


def _text(model_dir: str, token_ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(token_ids, skip_special_tokens=True)
