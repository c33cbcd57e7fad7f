"""vLLM's spellings of the structured-output backend (issue 38) through the real command line, HTTP and LLM:
``--structured-outputs-config`` (JSON, or key by key as ``--structured-outputs-config.backend``), the older
``--guided-decoding-backend`` / ``--guided-decoding-disable-*``, ``LLM(structured_outputs_config=...)`` and
``LLM(guided_decoding_backend=...)`` choose the server's backend or are refused with one line naming the key;
a request that names another backend than the server's is a ValueError (HTTP 400), as in vLLM V1.
``--enable-tokenizer-info-endpoint`` is accepted (GET /tokenizer_info is always served)."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from serve_support import serve_args, serve_configs, start_server
from test_vllm_serve_flags import refused_line

from lora_runner import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

OURS = dict(device="cpu", max_loras=2, max_lora_rank=16, max_num_seqs=4, max_model_len=64, block_size=4)
GREEDY = dict(temperature=0.0, max_tokens=6)
REGEX = r"[ab]{2,5}"


@pytest.mark.parametrize("flags, backend", [
    ([], "auto"),
    (["--structured-outputs-config", '{"backend": "guidance"}'], "guidance"),
    (["--structured-outputs-config", '{"backend": "llguidance", "disable_fallback": true}'], "guidance"),
    (["--structured-outputs-config.backend", "xgrammar"], "xgrammar"),
    (["--structured-outputs-config.backend", "xgrammar", "--structured-outputs-config.disable-fallback"], "xgrammar"),
    (["--structured-outputs-config", '{"disable_additional_properties": true, "reasoning_parser": ""}'], "auto"),
    (["--guided-decoding-backend", "xgrammar", "--guided-decoding-disable-fallback"], "xgrammar"),
    (["--guided-decoding-backend", "llguidance", "--guided-decoding-disable-additional-properties"], "guidance"),
    (["--guided-decoding-backend", "auto", "--structured-outputs-backend", "xgrammar"], "xgrammar"),
    (["--structured-outputs-config", '{"backend": "guidance"}', "--structured-outputs-backend", "guidance"],
     "guidance"),
    (["--enable-tokenizer-info-endpoint"], "auto"),
])
def test_vllm_spellings_choose_the_backend(engine_checkpoint, flags, backend):
    engine, _, _ = serve_configs(serve_args(engine_checkpoint[0], {}, extra=flags))
    assert engine.structured_outputs_backend == backend


def _refused(capsys, monkeypatch, argv: list[str]) -> str:
    """The one line `lora-runner serve` ends with (exit status 2); a command line that passes ends with
    "would serve" instead of serving forever."""
    def no_serving(*args):
        raise ValueError("would serve")

    monkeypatch.setattr("lora_runner.entrypoints.cli.bind_listen_socket", no_serving)
    return refused_line(capsys, argv)


@pytest.mark.parametrize("flags, named", [
    (["--guided-decoding-backend", "outlines"], "--guided-decoding-backend: backend='outlines'"),
    (["--structured-outputs-config", '{"backend": "lm-format-enforcer"}'], "backend='lm-format-enforcer'"),
    (["--structured-outputs-config.disable_any_whitespace", "true"], "disable_any_whitespace=True"),
    (["--guided-decoding-disable-any-whitespace"], "--guided-decoding-disable-any-whitespace: disable_any_whitespace"),
    (["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'], "reasoning_parser='deepseek_r1'"),
    (["--structured-outputs-config", '{"enable_in_reasoning": true}'], "enable_in_reasoning=True"),
    (["--structured-outputs-config", '{"backend": "xgrammar", "speed": 2}'], "unknown key 'speed'"),
    (["--structured-outputs-config", '["guidance"]'], "--structured-outputs-config"),
    (["--structured-outputs-config", '{"backend": "xgrammar"}', "--guided-decoding-backend", "guidance"],
     "name different structured-output backends"),
    (["--structured-outputs-backend", "guidance", "--structured-outputs-config.backend", "xgrammar"],
     "--structured-outputs-backend guidance and --structured-outputs-config xgrammar"),
])
def test_what_cannot_be_honoured_is_one_line_naming_the_flag_and_key(engine_checkpoint, capsys, monkeypatch, flags,
                                                                    named):
    line = _refused(capsys, monkeypatch, [engine_checkpoint[0], "--device", "cpu", *flags])
    assert line.startswith("lora-runner") and named in line and "--help" not in line.split(":")[0]


@pytest.fixture(scope="module")
def xgrammar_server(engine_checkpoint):
    """(server, state) started the vLLM way on the xgrammar backend."""
    args = serve_args(engine_checkpoint[0], {}, extra=["--structured-outputs-config", '{"backend": "xgrammar"}',
                                                       "--enable-tokenizer-info-endpoint"])
    server, state = start_server(args)
    yield server, state
    server.stop()


def _complete(server, structured_outputs: dict) -> httpx.Response:
    body = {"model": "base", "prompt": "pick", **GREEDY, "structured_outputs": structured_outputs}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)


def test_a_request_naming_another_backend_is_a_400_and_its_own_is_served(xgrammar_server):
    server, state = xgrammar_server
    assert state.engine.engine.config.structured_outputs_backend == "xgrammar"
    plain = _complete(server, {"regex": REGEX})
    assert plain.status_code == 200, plain.text
    for backend in ("xgrammar", "auto"):
        same = _complete(server, {"regex": REGEX, "backend": backend})
        assert same.status_code == 200 and same.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    for backend, named in (("guidance", "differs from this server's backend 'xgrammar'"),
                           ("llguidance", "differs from this server's backend 'xgrammar'"),
                           ("outlines", "structured_outputs.backend='outlines' is not supported")):
        other = _complete(server, {"regex": REGEX, "backend": backend})
        assert other.status_code == 400, (backend, other.text)
        assert named in other.json()["error"]["message"]


def test_tokenizer_info_is_served_with_or_without_the_vllm_flag(xgrammar_server):
    server, _ = xgrammar_server
    info = httpx.get(f"{server.base_url}/tokenizer_info", timeout=30)
    assert info.status_code == 200 and info.json()


def test_llm_takes_vllms_structured_outputs_config_and_refuses_another_backend_per_request(engine_checkpoint):
    path = engine_checkpoint[0]
    llm = LLM(path, structured_outputs_config={"backend": "xgrammar", "disable_fallback": True}, **OURS)
    try:
        assert llm.engine.config.structured_outputs_backend == "xgrammar"
        ours = llm.generate(["pick"], SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX), **GREEDY),
                            use_tqdm=False)
        named = GuidedDecodingParams(regex=REGEX, backend="xgrammar", disable_additional_properties=True)
        theirs = llm.generate(["pick"], SamplingParams(guided_decoding=named, **GREEDY), use_tqdm=False)
        assert theirs[0].outputs[0].token_ids == ours[0].outputs[0].token_ids
        for other in (GuidedDecodingParams(regex=REGEX, backend="guidance"), dict(regex=REGEX, backend="llguidance")):
            with pytest.raises(ValueError, match="backend='guidance' differs from this server's backend 'xgrammar'"):
                llm.generate(["pick"], SamplingParams(guided_decoding=other, **GREEDY), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs, backend", [
    (dict(guided_decoding_backend="llguidance"), "guidance"),
    (dict(guided_decoding_backend="xgrammar", guided_decoding_disable_fallback=True), "xgrammar"),
    (dict(structured_outputs_config={"disable_additional_properties": True}), "auto"),
])
def test_llm_takes_the_older_guided_decoding_keywords(engine_checkpoint, kwargs, backend):
    llm = LLM(engine_checkpoint[0], **kwargs, **OURS)
    try:
        assert llm.engine.config.structured_outputs_backend == backend
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs, named", [
    (dict(guided_decoding_backend="outlines"), "LLM(guided_decoding_backend='outlines') is not supported"),
    (dict(structured_outputs_config={"backend": "outlines"}), "structured_outputs_config): backend='outlines'"),
    (dict(structured_outputs_config={"disable_any_whitespace": True}), "disable_any_whitespace=True"),
    (dict(guided_decoding_disable_any_whitespace=True), "guided_decoding_disable_any_whitespace=True"),
    (dict(structured_outputs_config={"reasoning_parser": "qwen3"}), "reasoning_parser='qwen3'"),
    (dict(structured_outputs_config="guidance"), "structured_outputs_config) must be a dict"),
    (dict(structured_outputs_config={"backend": "guidance"}, structured_outputs_backend="xgrammar"),
     "both structured_outputs_config"),
    (dict(structured_outputs_config={"backend": "guidance"}, guided_decoding_backend="xgrammar"), "both"),
])
def test_llm_refuses_what_it_cannot_honour_naming_the_key(engine_checkpoint, kwargs, named):
    with pytest.raises(ValueError) as refused:
        LLM(engine_checkpoint[0], **kwargs, **OURS)
    assert named in str(refused.value) and "\n" not in str(refused.value)


def test_a_backend_this_engine_lacks_is_refused_where_the_request_is_written():
    with pytest.raises(ValueError, match="guided_decoding.backend='outlines' is not supported"):
        GuidedDecodingParams(regex=REGEX, backend="outlines")
    with pytest.raises(ValueError, match="structured_outputs.backend='lm-format-enforcer'"):
        StructuredOutputsParams(regex=REGEX, backend="lm-format-enforcer")
    assert StructuredOutputsParams(regex=REGEX, backend="llguidance").backend == "guidance"
    assert StructuredOutputsParams(regex=REGEX, backend="guidance").key() == StructuredOutputsParams(regex=REGEX).key()
    assert json.loads(StructuredOutputsParams(choice=["a"], backend="xgrammar").key()[1]) == ["a"]


@pytest.mark.parametrize("flags", [["--structured-outputs-backend", "xgrammar"],
                                   ["--structured-outputs-config", '{"backend": "xgrammar"}'],
                                   ["--guided-decoding-backend", "xgrammar"]])
def test_the_xgrammar_backend_without_xgrammar_is_one_line_at_start(engine_checkpoint, capsys, monkeypatch, flags):
    """xgrammar is an extra (pip install -e ".[xgrammar]"): asking for it without it is said before the model
    loads, naming the flag and the install; the default (auto: llguidance) serves without it."""
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    line = _refused(capsys, monkeypatch, [engine_checkpoint[0], "--device", "cpu", *flags])
    assert f"{flags[0]} xgrammar needs the xgrammar package" in line and '".[xgrammar]"' in line
    assert _refused(capsys, monkeypatch, [engine_checkpoint[0], "--device", "cpu"]).endswith("would serve")


def test_xgrammar_is_an_extra_that_test_includes_and_llguidance_a_dependency():
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    names = [dep.split(">")[0].split("=")[0] for dep in project["dependencies"]]
    assert "llguidance" in names and "xgrammar" not in names
    extras = project["optional-dependencies"]
    assert any(dep.startswith("xgrammar") for dep in extras["xgrammar"])
    assert any(dep.startswith("xgrammar") for dep in extras["test"])
