"""First contact with `lora-runner serve`, round 3: a startup adapter trained on another base is warned
about once (not by the startup check and again by the load), and the shipped demo adapters name their
base as the demo serves it (no warning at all)."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path

import pytest
from factories import edit_adapter_config, save_adapter_copy

from adapters.base_model import model_name, same_base_model
from lora_runner.entrypoints import cli

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


def _serve_until_up(monkeypatch, argv: list[str]) -> None:
    """cli.main through the model load and uvicorn's startup, then straight to shutdown."""
    async def no_main_loop(self):
        return None

    monkeypatch.setattr(cli.AnnouncingServer, "main_loop", no_main_loop)
    assert cli.main(["serve", *argv, "--device", "cpu", "--port", str(_free_port())]) == 0


def test_a_base_mismatch_is_warned_once_per_adapter(monkeypatch, engine_checkpoint, tmp_path, caplog):
    model, _, adapters = engine_checkpoint
    lora = save_adapter_copy(adapters["r4"][0], tmp_path / "elsewhere")
    edit_adapter_config(lora, base_model_name_or_path="org/another-base")
    with caplog.at_level(logging.WARNING):
        _serve_until_up(monkeypatch, [model, "--lora-modules", f"other-base={lora}", f"again={lora}"])
    warned = [r.getMessage() for r in caplog.records if "org/another-base" in r.getMessage()]
    assert len(warned) == 2 and "'other-base'" in warned[0] and "'again'" in warned[1], warned  # one per adapter


def test_the_same_model_by_name_is_no_mismatch():
    demo_folder = "/home/me/.cache/lora-runner/demo/models/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f"
    assert same_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", demo_folder)
    assert same_base_model("/root/.cache/x/SmolLM2-135M-Instruct.Q4_1-b179c9523d0e6a0f/", demo_folder)
    assert same_base_model("HuggingFaceTB/SmolLM2-135M-Instruct", "/models/SmolLM2-135M-Instruct.Q4_K_M.gguf")
    assert not same_base_model("org/another-base", "org/our-base")
    assert not same_base_model("HuggingFaceTB/SmolLM2-360M-Instruct", demo_folder)
    assert model_name("/") == "" and not same_base_model("/", "/other/")


def test_the_shipped_demo_adapters_record_the_model_the_demo_serves():
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import smollm2
    finally:
        sys.path.remove(str(REPO / "examples"))
    served = os.path.join("/any/cache/models", f"{Path(smollm2.GGUF_NAME).stem}-{smollm2.GGUF_SHA256[:16]}")
    configs = sorted((REPO / "examples" / "demo_adapters").glob("*/*/*/adapter_config.json"))
    assert len(configs) == 5
    for path in configs:
        config = json.loads(path.read_text())
        recorded = config["base_model_name_or_path"]
        assert recorded == smollm2.BASE_HUB_ID and same_base_model(recorded, served), path
        assert not os.path.isabs(config.get("tokenizer_name_or_path") or ""), path  # no trainer's path shipped


@pytest.mark.parametrize("kind", ["lora", "prompt"])
def test_loading_again_does_not_warn_again(engine_checkpoint, tmp_path, caplog, kind):
    from factories import model_spec, save_prompt_adapter

    from adapters.lora import load_lora
    from adapters.prompt import load_prompt_adapter

    _, hf, adapters = engine_checkpoint
    spec = type(model_spec(hf))(**{**model_spec(hf).__dict__, "model_name": "org/our-base"})
    path = tmp_path / kind
    if kind == "lora":
        save_adapter_copy(adapters["r4"][0], path)
    else:
        save_prompt_adapter(hf, path)
    edit_adapter_config(path, base_model_name_or_path="org/their-base")
    with caplog.at_level(logging.WARNING):
        for _ in range(3):  # the startup check, the load, a reload after eviction
            if kind == "lora":
                load_lora(f"reloaded-{kind}", str(path), spec, max_lora_rank=8)
            else:
                load_prompt_adapter(f"reloaded-{kind}", str(path), spec, max_prompt_adapter_tokens=8)
    assert len([r for r in caplog.records if "org/their-base" in r.getMessage()]) == 1


def test_serving_the_demos_gguf_does_not_convert_it_again(monkeypatch, engine_checkpoint, tmp_path):
    """The demo converts its .gguf into its own cache, beside the file; `serve FILE.gguf` (twice) then uses
    that conversion instead of converting again into the default cache."""
    import shutil

    from lora_runner.model import gguf

    sys.path.insert(0, str(REPO / "examples"))
    try:
        import smollm2
    finally:
        sys.path.remove(str(REPO / "examples"))
    conversions = []

    def convert(path, out_dir):  # stand-in for the dequantization: the tiny model as its result
        conversions.append(path)
        shutil.copytree(engine_checkpoint[0], out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    monkeypatch.setenv("LORA_RUNNER_CACHE", str(tmp_path / "default-cache"))
    demo_root = tmp_path / "demo"
    (demo_root / "models").mkdir(parents=True)
    gguf_file = demo_root / "models" / smollm2.GGUF_NAME
    gguf_file.write_bytes(b"the demo's weights")  # fetch_gguf finds it there and fetches nothing
    converted = smollm2.real_model_dir(demo_root)
    assert conversions == [gguf_file] and converted.parent == demo_root / "models"
    for _ in range(2):
        _serve_until_up(monkeypatch, [str(gguf_file)])
    assert conversions == [gguf_file] and not (tmp_path / "default-cache").exists()


def _model_with_generation_config(source: str, path: Path, **values) -> str:
    import shutil

    shutil.copytree(source, path)
    file = path / "generation_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    file.write_text(json.dumps({**config, **values}))
    return str(path)


def test_llm_takes_generation_config_defaults_as_vllm_does(engine_checkpoint, tmp_path):
    from lora_runner import LLM, SamplingParams
    from lora_runner.entrypoints.openai.generation_defaults import sampling_defaults

    model = _model_with_generation_config(engine_checkpoint[0], tmp_path / "model", temperature=0.0, top_k=5,
                                          max_new_tokens=3, repetition_penalty=1.3)
    prompt = [1, 5, 9, 14]
    auto = LLM(model, device="cpu")  # vLLM's default: generation_config="auto"
    try:
        defaults = auto.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.repetition_penalty) == (
            0.0, 5, 3, 1.3)
        assert defaults == sampling_defaults("auto", model).sampling_params()  # the server's reader, the same values
        got = auto.generate(prompt, use_tqdm=False)[0].outputs[0].token_ids
        explicit = SamplingParams(temperature=0.0, top_k=5, max_tokens=3, repetition_penalty=1.3)
        assert list(got) == list(auto.generate(prompt, explicit, use_tqdm=False)[0].outputs[0].token_ids)
        assert len(got) == 3
        # a call's own params win whole, as in vLLM: SamplingParams() is max_tokens=16, not 3
        own = auto.generate(prompt, SamplingParams(ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
        assert len(own) == 16
    finally:
        auto.close()
    plain = LLM(model, device="cpu", generation_config="vllm")
    try:
        assert plain.get_default_sampling_params() == SamplingParams()
    finally:
        plain.close()


def test_llm_generation_config_folder_and_bad_values(engine_checkpoint, tmp_path):
    from lora_runner import LLM

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"top_p": 0.5, "max_new_tokens": 2}))
    llm = LLM(engine_checkpoint[0], device="cpu", generation_config=str(folder))
    try:
        params = llm.get_default_sampling_params()
        assert (params.top_p, params.max_tokens) == (0.5, 2)
    finally:
        llm.close()
    with pytest.raises(ValueError, match="no generation_config.json in that folder"):
        LLM(engine_checkpoint[0], device="cpu", generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm' or a folder"):
        LLM(engine_checkpoint[0], device="cpu", generation_config=3)


_PARSE_ONLY = """
import sys
from lora_runner.serve import console_main, main
try:
    {call}
except SystemExit as exit:
    print("exit", exit.code)
print("loaded:", sorted(m for m in ("torch", "fastapi", "uvicorn", "transformers", "adapters") if m in sys.modules))
"""


@pytest.mark.parametrize("call", ["main(['--help'])", "console_main(['serve', '--help'])",
                                  "console_main(['serve', 'model', '--lora-modules', 'no-equals-sign'])",
                                  "main(['model', '--port', 'eighty'])"])
def test_help_and_option_errors_answer_without_loading_the_server(call):
    """`serve --help` took seconds importing torch and the server to print text: the command line is parsed
    before any of them loads (the before/after seconds are in the commit message)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", _PARSE_ONLY.format(call=call)], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.stdout.splitlines()[-1] == "loaded: []", done.stdout + done.stderr
    assert ("exit 0" if "--help" in call else "exit 2") in done.stdout
    if "--help" in call:
        assert "--tool-call-parser" in done.stdout and "--max-num-seqs" in done.stdout
    else:
        assert done.stderr.count("\n") == 1 and "error:" in done.stderr, done.stderr


def test_the_command_lines_server_defaults_are_the_servers():
    import dataclasses

    from lora_runner.entrypoints.openai.connections import ConnectionLimits
    from lora_runner.entrypoints.openai.state import ServerConfig
    from lora_runner.entrypoints.serve_args import SERVER_DEFAULTS

    declared = {f.name: f.default for cls in (ServerConfig, ConnectionLimits) for f in dataclasses.fields(cls)}
    assert {name: declared[name] for name in SERVER_DEFAULTS} == SERVER_DEFAULTS


def test_python_m_serve_help_in_a_subprocess():
    import subprocess

    done = subprocess.run([sys.executable, "-m", "lora_runner.serve", "--help"], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert done.returncode == 0 and "usage: python -m lora_runner.serve" in done.stdout
