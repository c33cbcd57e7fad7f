"""Per-request draft adapters of the "draft_model" method (lora_runner.spec_decode.draft_adapters):
``LoRARequest(..., draft_lora_path=PATH)`` runs the draft model with that PEFT LoRA for that request.

With the draft = the target and each request's draft adapter = its own target adapter (PEFT-written), the
draft computes exactly what the verify pass computes, so every draft of a mixed batch (LoRAs of two ranks,
base rows) is accepted, and the tokens are those without speculation; a draft adapter that differs gets
lower acceptance and the same tokens; a bad draft adapter (another base model's shapes, over max_lora_rank,
a pickle without allow_pickle) fails its own request with its AdapterError while the others go on; more
draft adapters than draft slots (eviction) stays exact, every draft still accepted, and they take turns;
draft graphs and tp=2 alike. Loading and serving them: test_spec_decode_draft_lora_serve.py."""

from __future__ import annotations

import random

import pytest

from adapters import AdapterTooLargeError, InvalidAdapterError, LoRARequest, UnsafeAdapterError
from engine_support import run_to_completion
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
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    # wait_s: a request may wait for its draft adapter's load
    done = run_to_completion(engine, [(f"r{i}", prompt, params, lora) for i, (prompt, lora) in enumerate(requests)],
                             per_step=2, wait_s=5)
    done = {int(request_id[1:]): output for request_id, output in done.items()}
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
    """The draft's forwards in (emulated) graphs (captured with the draft's LoRA: test_spec_decode_draft_graphs);
    at tp=2 the target's ranks verify and the draft runs with its adapters on the engine's
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
