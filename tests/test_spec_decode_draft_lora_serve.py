"""Draft adapters (LoRARequest.draft_lora_path, lora_runner.spec_decode.draft_adapters) where adapters are
loaded and served: add_lora / LLM.generate / serve_adapter load and validate a LoRA's draft adapter with it
(a bad one raises before any work, nothing served), the server's --lora-modules JSON and
/v1/load_lora_adapter take "draft_path" (confined as lora_path is, beneath the same directory),
load_inplace reads the draft adapter again, and an engine without a draft model warns that it is unused."""

from __future__ import annotations

import argparse
import json
import shutil

import httpx
import pytest
from serve_support import serve_args, start_server
from test_spec_decode_draft_lora import model, prompts, spec

from adapters import AdapterTooLargeError, InvalidAdapterError, LoRARequest, UnsafeAdapterError
from lora_runner import LLM, LLMEngine, SamplingParams

__all__ = ["model"]  # the module fixture shared with the decoding tests


def test_json_lora_modules_name_a_draft_adapter():
    """`serve --lora-modules '{"name": ..., "path": ..., "draft_path": ...}'`: the served LoRARequest carries it
    (HTTP requests for the adapter use the served request); a bad draft_path is a usage error."""
    from lora_runner.entrypoints.cli import add_serve_arguments, startup_adapters

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(["m", "--lora-modules", '{"name": "sql", "path": "/a/sql", "draft_path": "/d/sql"}',
                              "chat=/a/chat"])
    assert startup_adapters(args).loras == (LoRARequest("sql", "/a/sql", draft_lora_path="/d/sql"),
                                            LoRARequest("chat", "/a/chat"))
    with pytest.raises(SystemExit):
        parser.parse_args(["m", "--lora-modules", '{"name": "sql", "path": "/a/sql", "draft_path": 3}'])
    args = parser.parse_args(["m", "--prompt-adapters", '{"name": "s", "path": "/a/s", "draft_path": "/d/s"}'])
    with pytest.raises(ValueError, match="draft_path names a LoRA of the speculative draft model"):
        startup_adapters(args)


def test_add_lora_and_generate_refuse_a_bad_draft_adapter_before_any_work(model):
    """add_lora loads and validates a LoRA's draft adapter too, so LLM.generate raises its AdapterError
    before any prompt runs (README: a bad adapter in LLM.generate raises before any work)."""
    path, dirs = model
    llm = LLM(path, device="cpu", max_model_len=64, block_size=4, max_lora_rank=16, speculative_config=spec(path))
    with pytest.raises(AdapterTooLargeError, match="the draft model's adapter .*over-rank.* of LoRA 'r4'"):
        llm.engine.add_lora(LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["over-rank"]))
    bad = LoRARequest("r8-rslora", dirs["r8-rslora"], draft_lora_path=dirs["pickle"])
    with pytest.raises(UnsafeAdapterError, match="the draft model's adapter"):
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=2), lora_request=[None, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.stats.steps == 0
    good = LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["r4"])
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), lora_request=good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.close()


def test_serving_an_adapter_validates_its_draft_adapter(model):
    """serve_adapter (the server's --lora-modules and runtime loads) loads a LoRA's draft adapter with it: a
    bad one raises its AdapterError and nothing is served; a good one serves, its request carrying it."""
    path, dirs = model
    engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, max_lora_rank=16,
                       speculative_config=spec(path))
    with pytest.raises(InvalidAdapterError, match="the draft model's adapter"):
        engine.serve_adapter(LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["wrong-shapes"]))
    assert engine.served_adapter("r4") is None
    served = engine.serve_adapter(LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["r4"]))
    assert served.request.draft_lora_path == dirs["r4"]
    engine.close()


def test_the_server_serves_draft_adapters(model, tmp_path):
    """Over HTTP: `--lora-modules` JSON with "draft_path", and /v1/load_lora_adapter's "draft_path", confined
    as lora_path is and beneath the same directory (403 otherwise); a bad draft adapter answers 422 naming
    its path relative to that directory; requests on a served adapter draft with its draft adapter."""
    path, dirs = model
    allowed, root = tmp_path / "allowed", tmp_path / "root"
    root.mkdir()
    for name in ("r4", "r8-rslora", "wrong-shapes"):
        shutil.copytree(dirs[name], allowed / name)
    key = "draft-admin-key-0000"
    server, state = start_server(serve_args(path, {}, extra=[
        "--lora-modules", json.dumps({"name": "sql", "path": dirs["r4"], "draft_path": dirs["r4"]}),
        "--speculative-config", json.dumps(spec(path)), "--api-key", key, "--allow-runtime-lora-updating",
        "--allowed-adapter-paths", str(allowed), "--adapter-root", str(root)]))
    try:
        def load(name, lora_path, draft_path):
            return httpx.post(server.base_url + "/v1/load_lora_adapter", timeout=60,
                              headers={"Authorization": f"Bearer {key}"},
                              json={"lora_name": name, "lora_path": lora_path, "draft_path": draft_path})
        assert load("chat", str(allowed / "r8-rslora"), str(allowed / "r8-rslora")).status_code == 200
        escaped = load("x", str(allowed / "r4"), dirs["r4"])  # outside the allowed directory
        assert escaped.status_code == 403, escaped.text
        other_dir = load("x", str(allowed / "r4"), "r4")  # relative: the adapter root, another directory
        assert other_dir.status_code == 403 and "same adapter directory" in other_dir.text, other_dir.text
        bad = load("x", str(allowed / "r4"), str(allowed / "wrong-shapes"))
        assert bad.status_code == 422 and "the draft model's adapter 'wrong-shapes'" in bad.text, bad.text
        assert str(allowed) not in bad.text
        for name, adapter in (("sql", "r4"), ("chat", "r8-rslora")):
            served = state.engine.engine.adapters.served(name)
            assert served.request.draft_lora_path == (dirs["r4"] if name == "sql" else str(allowed / adapter))
            reply = httpx.post(server.base_url + "/v1/completions", timeout=60,
                               headers={"Authorization": f"Bearer {key}"},
                               json={"model": name, "prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0,
                                     "ignore_eos": True})
            assert reply.status_code == 200, reply.text
        by_adapter = state.engine.engine.stats.spec_decode_by_adapter
        for name in ("sql", "chat"):
            stats = by_adapter[name]
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, (name, stats)
    finally:
        server.stop()


def test_load_inplace_reads_the_draft_adapter_again(model, tmp_path):
    """Replacing a served LoRA in place (its files rewritten under the same paths) reads its draft adapter
    again too: after the draft adapter's files change, new requests draft with the new weights."""
    path, dirs = model
    draft_dir = tmp_path / "draft"
    shutil.copytree(dirs["r4"], draft_dir)
    engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, max_lora_rank=16,
                       speculative_config=spec(path))
    request = LoRARequest("r4", dirs["r4"], draft_lora_path=str(draft_dir))
    engine.serve_adapter(request)

    def acceptance(request_id):
        engine.add_request(request_id, prompts(1, seed=11)[0],
                           SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           lora_request=request)
        done = []
        while engine.has_unfinished_requests():
            engine.wait_for_work(timeout=5)
            done += [out for out in engine.step() if out.finished]
        stats = done[0].spec_decode
        return stats.num_accepted_tokens / stats.num_draft_tokens
    assert acceptance("before") == 1.0
    shutil.rmtree(draft_dir)
    shutil.copytree(dirs["r8-rslora"], draft_dir)
    engine.serve_adapter(request, replace=True)
    assert acceptance("after") < 1.0
    engine.close()


def test_a_draft_adapter_without_a_draft_model_is_unused_with_a_warning(model, caplog):
    path, dirs = model
    engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, max_lora_rank=16)
    engine.add_lora(LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["over-rank"]))  # never read: no error
    assert "names a draft adapter, unused: the engine has no draft model" in caplog.text
    engine.close()
