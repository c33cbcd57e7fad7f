"""vLLM's serve flags through the real command line (accepted, or refused with one line naming the
flag, exit 2) and runtime LoRA loading the vLLM way (VLLM_ALLOW_RUNTIME_LORA_UPDATING, absolute
paths, several loads at once on a server without tenant keys)."""

from __future__ import annotations

import json
import logging
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serve_support import serve_args, serve_configs, start_server

from lora_runner.entrypoints.cli import main
from lora_runner.entrypoints.openai.generation_defaults import SamplingDefaults, sampling_defaults


def refused_line(capsys, argv: list[str]) -> str:
    """The one line `lora-runner serve` ends with (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", *argv])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("flags, named", [
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--tokenizer", "/elsewhere/tokenizer"], "--tokenizer"),
    (["--lora-dtype", "bfloat16"], "--lora-dtype"),
    (["--tool-call-parser", "kimi_k2"], "--tool-call-parser kimi_k2"),
    (["--generation-config", "/no/such/folder"], "--generation-config"),
    (["--chat-template", "/no/such/template.jinja"], "--chat-template"),
])
def test_a_vllm_flag_that_cannot_be_honoured_is_one_line_naming_it(engine_checkpoint, capsys, flags, named):
    line = refused_line(capsys, [engine_checkpoint[0], "--device", "cpu", *flags])
    assert line.startswith("lora-runner: error: ") and named in line


def test_a_bad_option_value_is_one_line_not_the_usage(engine_checkpoint, capsys):
    line = refused_line(capsys, [engine_checkpoint[0], "--lora-modules", "no-equals-sign"])
    assert "--lora-modules" in line and "usage" not in line


def test_the_flags_a_vllm_command_line_carries_are_accepted(engine_checkpoint, tmp_path):
    model = engine_checkpoint[0]
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    _, server, _ = serve_configs(serve_args(model, {}, extra=[
        "--tokenizer", model + "/", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--lora-dtype",
        "auto", "--disable-log-requests", "--chat-template", str(tmp_path / "t.jinja"), "--generation-config",
        "vllm"]))
    assert server.chat_template == "{{ messages[0]['content'] }}" and server.generation_config == "vllm"
    _, inline, _ = serve_configs(serve_args(model, {}, extra=["--chat-template", "{{ 'x' }}"]))
    assert inline.chat_template == "{{ 'x' }}"


def test_generation_config_settings(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True, "eos_token_id": 2}))
    wanted = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, max_tokens=7)
    assert sampling_defaults("auto", str(tmp_path)) == wanted
    assert sampling_defaults(str(tmp_path), "/model/without/file") == wanted
    assert sampling_defaults("vllm", str(tmp_path)) == SamplingDefaults()
    assert sampling_defaults("auto", str(tmp_path / "missing")) == SamplingDefaults()


def test_the_vllm_environment_variable_enables_runtime_loading(engine_checkpoint, monkeypatch):
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    assert serve_configs(serve_args(engine_checkpoint[0], {}))[1].allow_runtime_lora_updating
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0")
    assert not serve_configs(serve_args(engine_checkpoint[0], {}))[1].allow_runtime_lora_updating


@pytest.fixture(scope="module")
def loading(engine_checkpoint, tmp_path_factory):
    """(server, state, allowed dir) without keys, runtime loading on through vLLM's environment variable,
    absolute paths allowed beneath one directory."""
    allowed = tmp_path_factory.mktemp("vllm-loads")
    for name, (path, _) in engine_checkpoint[2].items():
        shutil.copytree(path, allowed / name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "true")
        server, state = start_server(serve_args(engine_checkpoint[0], {}, extra=[
            "--allowed-adapter-paths", str(allowed), "--max-cpu-loras", "8"]))
    yield server, state, allowed
    server.stop()


def _load(server, name: str, path: str) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path},
                      timeout=60)


def test_three_loads_at_once_on_a_keyless_server_all_succeed(loading, monkeypatch):
    server, state, allowed = loading
    names = ["r4", "r8-rslora", "r16-mlp"]
    together = threading.Barrier(len(names), timeout=20)  # each load waits until all three run at once
    serve_adapter = state.engine.serve_adapter

    def serve_together(*args, **kwargs):
        together.wait()
        return serve_adapter(*args, **kwargs)

    monkeypatch.setattr(state.engine, "serve_adapter", serve_together)
    with ThreadPoolExecutor(len(names)) as pool:
        responses = list(pool.map(lambda name: _load(server, f"rt-{name}", str(allowed / name)), names))
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    models = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"]
    assert {f"rt-{name}" for name in names} <= {m["id"] for m in models}


def test_a_relative_path_without_adapter_root_names_both_flags(loading):
    response = _load(loading[0], "relative", "r4")
    assert response.status_code == 403
    assert "--adapter-root" in response.text and "--allowed-adapter-paths" in response.text


def test_runtime_loading_without_a_place_to_load_from_is_said_at_start(engine_checkpoint, caplog):
    with caplog.at_level(logging.WARNING, logger="lora_runner.entrypoints.launch"):
        server, _ = start_server(serve_args(engine_checkpoint[0], {}, extra=["--allow-runtime-lora-updating"]))
    try:
        said = [r.getMessage() for r in caplog.records if "every load will be refused" in r.getMessage()]
        assert len(said) == 1 and "--allowed-adapter-paths" in said[0]
        response = _load(server, "x", "/abs/path")
        assert response.status_code == 403 and "--allowed-adapter-paths" in response.text
    finally:
        server.stop()
