"""Per-request draft adapters of the "draft_model" method (lora_runner.spec_decode.draft_adapters):
``LoRARequest(..., draft_lora_path=PATH)`` runs the draft model with that PEFT LoRA for that request.

With the draft = the target and each request's draft adapter = its own target adapter (PEFT-written), the
draft computes exactly what the verify pass computes, so every draft of a mixed batch (LoRAs of two ranks,
base rows) is accepted, and the tokens are those without speculation; a draft adapter that differs gets
lower acceptance and the same tokens; a bad draft adapter (another base model's shapes, over max_lora_rank,
a pickle without allow_pickle) fails its own request with its AdapterError while the others go on; more
draft adapters than draft slots (eviction) stays exact, every draft still accepted, and they take turns;
draft graphs and tp=2 alike. add_lora / LLM.generate / serve_adapter / the server's --lora-modules JSON and
/v1/load_lora_adapter ("draft_path") load and validate a draft adapter with its LoRA, and load_inplace
reads it again."""

from __future__ import annotations

import random

import pytest

from adapters import AdapterTooLargeError, InvalidAdapterError, LoRARequest, UnsafeAdapterError
from factories import build_tiny_model, save_lora
from lora_runner import LLMEngine, SamplingParams
from lora_runner.worker.cuda_graphs import RerunGraph

K = 3


def spec(path, **keys) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K, **keys}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(6, 14))] for _ in range(n)]


def run(path, speculative_config, requests, max_loras=2, tp=1, before=None):
    """{index: RequestOutput} of greedy requests [(prompt, LoRARequest | None)] and the engine; the target
    adapters are loaded before the first step, two requests join per step. before(engine): called first."""
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64, block_size=4, max_loras=max_loras,
                       max_lora_rank=16, max_num_batched_tokens=16, speculative_config=speculative_config,
                       cpu_threads=1, tensor_parallel_size=tp)
    if before is not None:
        before(engine)
    for _, lora in requests:
        if lora is not None:
            engine.add_lora(LoRARequest(lora.name, lora.path))
    pending, done = list(enumerate(requests)), {}
    while pending or engine.has_unfinished_requests():
        for _ in range(2):
            if pending:
                i, (prompt, lora) = pending.pop(0)
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                                   lora_request=lora)
        engine.wait_for_work(timeout=5)  # a request waiting for its draft adapter's load
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[1:])] = out
    engine.close()
    return done, engine


@pytest.fixture(scope="module")
def model(engine_checkpoint, tmp_path_factory):
    """(model dir, {name: adapter dir}) with the conftest's LoRAs and broken draft adapters."""
    path, hf, adapters = engine_checkpoint
    root = tmp_path_factory.mktemp("draft-lora")
    dirs = {name: adapters[name][0] for name in ("r4", "r8-rslora", "r16-patterns")}
    other = build_tiny_model("llama", seed=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    save_lora(other, root / "wrong-shapes", r=4)
    save_lora(hf, root / "over-rank", r=32, seed=9)
    save_lora(hf, root / "pickle", r=4, seed=7).save_pretrained(str(root / "pickle"), safe_serialization=False)
    (root / "pickle" / "adapter_model.safetensors").unlink(missing_ok=True)
    dirs.update({name: str(root / name) for name in ("wrong-shapes", "over-rank", "pickle")})
    return path, dirs


def mixed(dirs, draft_of, n=9, seed=3):
    """n requests cycling base / r4 / r8-rslora; draft_of: adapter name -> its draft adapter dir (None: none)."""
    names = [None, "r4", "r8-rslora"]
    return [(prompt, None if names[i % 3] is None else
             LoRARequest(names[i % 3], dirs[names[i % 3]], draft_lora_path=draft_of(names[i % 3])))
            for i, prompt in enumerate(prompts(n, seed))]


def tokens(done):
    return {i: out.outputs[0].token_ids for i, out in done.items()}


@pytest.fixture(scope="module")
def plain(model):
    """Tokens without speculation of the mixed batch (draft adapters named or not: no draft runs)."""
    path, dirs = model
    done, _ = run(path, None, mixed(dirs, lambda name: None))
    return tokens(done)


def assert_every_draft_accepted(done, label):
    for i, out in done.items():
        stats = out.spec_decode
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens, (label, i, stats)


def test_the_targets_own_adapters_as_draft_adapters_accept_every_draft(model, plain):
    path, dirs = model
    done, engine = run(path, spec(path), mixed(dirs, lambda name: dirs[name]))
    assert tokens(done) == plain
    assert_every_draft_accepted(done, "draft adapters = target adapters")
    draft = engine.scheduler.speculator.proposer
    assert draft.adapters.manager.stats.lora_loads >= 2  # both draft adapters were written into draft slots
    assert draft.block_manager.num_free_blocks == draft.block_manager.num_blocks
    assert sorted(draft.adapters.tier.list()) == ["r4", "r8-rslora"]  # the draft's own CPU cache


def test_without_draft_adapters_adapter_rows_accept_less(model, plain):
    """The same batch, the draft without adapters (none named): the base rows still accept every draft,
    the adapter rows fewer; the tokens are the same."""
    path, dirs = model
    done, _ = run(path, spec(path), mixed(dirs, lambda name: None))
    assert tokens(done) == plain
    adapter_rows = [out.spec_decode for i, out in done.items() if i % 3]
    assert sum(s.num_accepted_tokens for s in adapter_rows) < sum(s.num_draft_tokens for s in adapter_rows)
    assert_every_draft_accepted({i: out for i, out in done.items() if i % 3 == 0}, "base rows")


def test_a_draft_adapter_that_differs_accepts_less_with_the_same_tokens(model, plain):
    """r4's requests draft with r8-rslora's adapter (and the reverse): fewer drafts accepted, same tokens."""
    path, dirs = model
    swapped = {"r4": dirs["r8-rslora"], "r8-rslora": dirs["r4"]}
    done, _ = run(path, spec(path), mixed(dirs, swapped.get))
    assert tokens(done) == plain
    adapter_rows = [out.spec_decode for i, out in done.items() if i % 3]
    assert sum(s.num_accepted_tokens for s in adapter_rows) < sum(s.num_draft_tokens for s in adapter_rows)


@pytest.mark.parametrize("bad, error, message", [
    ("wrong-shapes", InvalidAdapterError, "expected"),
    ("over-rank", AdapterTooLargeError, "rank 32, over max_lora_rank=16"),
    ("pickle", UnsafeAdapterError, "allow_pickle=True"),
])
def test_a_bad_draft_adapter_fails_only_its_own_request(model, plain, bad, error, message):
    path, dirs = model
    requests = mixed(dirs, lambda name: dirs[name])
    requests[4] = (requests[4][0], LoRARequest("r4", dirs["r4"], draft_lora_path=dirs[bad]))
    done, engine = run(path, spec(path), requests)
    failed = done.pop(4)
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert isinstance(failed.error, error) and message in str(failed.error), repr(failed.error)
    assert tokens(done) == {i: t for i, t in plain.items() if i != 4}
    assert_every_draft_accepted(done, f"beside {bad}")


def test_more_draft_adapters_than_draft_slots_stays_exact(model):
    """Three adapters (ranks 4, 8 and 16), each its own draft adapter, over one draft slot: they take turns
    (evicted LRU) and each draft still runs with its own adapter (every draft accepted)."""
    path, dirs = model
    names = [None, "r4", "r8-rslora", "r16-patterns"]
    requests = [(prompt, None if names[i % 4] is None else
                 LoRARequest(names[i % 4], dirs[names[i % 4]], draft_lora_path=dirs[names[i % 4]]))
                for i, prompt in enumerate(prompts(8, seed=4))]
    expected, _ = run(path, None, requests, max_loras=3)
    done, engine = run(path, spec(path, max_draft_loras=1), requests, max_loras=3)
    assert tokens(done) == tokens(expected)
    assert_every_draft_accepted(done, "one draft slot")
    stats = engine.scheduler.speculator.proposer.adapters.manager.stats
    assert stats.lora_evictions > 0, stats


def test_draft_adapters_take_turns_in_too_few_draft_slots(model):
    """One draft slot, two running requests with other draft adapters: the newer one gets the slot in its
    turn (not only once the older one finished, which here would be after it finished itself)."""
    path, dirs = model
    outputs = {}
    for speculative_config in (None, spec(path, max_draft_loras=1)):
        engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, max_lora_rank=16,
                           speculative_config=speculative_config)
        for name, max_tokens in (("r4", 40), ("r8-rslora", 6)):  # r4: ~10 steps at 4 tokens a step
            engine.add_lora(LoRARequest(name, dirs[name]))
            engine.add_request(name, prompts(1, seed=len(name))[0],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               lora_request=LoRARequest(name, dirs[name], draft_lora_path=dirs[name]))
        done = {}
        while engine.has_unfinished_requests():
            engine.wait_for_work(timeout=5)
            done.update({out.request_id: out for out in engine.step() if out.finished})
        engine.close()
        outputs[speculative_config is None] = done
    assert tokens(outputs[False]) == tokens(outputs[True])
    assert_every_draft_accepted(outputs[False], "one draft slot, two adapters")


def test_draft_adapters_with_draft_graphs_and_a_tensor_parallel_target(model, plain):
    """The draft's forwards in (emulated) graphs: a forward with draft-adapter rows runs eagerly, one of base
    rows alone replays; at tp=2 the target's ranks verify and the draft runs with its adapters on the engine's
    side. Every draft is still accepted, the tokens unchanged."""
    path, dirs = model
    requests = mixed(dirs, lambda name: dirs[name])

    def graphs(engine):
        engine.scheduler.speculator.proposer.forward.capture_graphs(K, make_graph=RerunGraph)
    done, engine = run(path, spec(path), requests, before=graphs)
    assert tokens(done) == plain
    assert_every_draft_accepted(done, "draft graphs")
    assert engine.scheduler.speculator.proposer.forward.graphs.num_replays > 0
    done, _ = run(path, spec(path), requests, tp=2)
    assert tokens(done) == plain
    assert_every_draft_accepted(done, "tp=2")


def test_a_request_whose_draft_adapter_cannot_load_after_close_fails(model):
    path, dirs = model
    engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, speculative_config=spec(path))
    engine.add_lora(LoRARequest("r4", dirs["r4"]))
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4),
                       lora_request=LoRARequest("r4", dirs["r4"], draft_lora_path=dirs["r4"]))
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4), lora_request=LoRARequest("r4", dirs["r4"]))
    engine.close()
    done = {}
    while engine.has_unfinished_requests():
        done.update({out.request_id: out for out in engine.step() if out.finished})
    assert done["a"].outputs[0].finish_reason == "error" and "closed" in str(done["a"].error)
    assert done["b"].outputs[0].finish_reason == "length"  # its adapters were ready: it completes


def test_draft_lora_path_is_checked_when_the_request_is_made():
    with pytest.raises(ValueError, match="draft_lora_path must be a non-empty string"):
        LoRARequest("a", "/x", draft_lora_path="")
    assert LoRARequest("a", "/x", draft_lora_path="/y").draft_request == LoRARequest("a", "/y")
    assert LoRARequest("a", "/x").draft_request is None


def test_json_lora_modules_name_a_draft_adapter():
    """`serve --lora-modules '{"name": ..., "path": ..., "draft_path": ...}'`: the served LoRARequest carries it
    (HTTP requests for the adapter use the served request); a bad draft_path is a usage error."""
    import argparse

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
    from lora_runner import LLM

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
    import json
    import shutil

    import httpx
    from serve_support import serve_args, start_server

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
    import shutil

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
