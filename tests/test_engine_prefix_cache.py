"""Prefix caching end to end: with caching on, every request's greedy tokens and logprobs equal the
same run with caching off and the transformers/PEFT oracle; a cached block is only ever hit by the
same (LoRA version, prompt-adapter version, salt); a flood evicts without failing or changing anyone.

The KV cache is poisoned (NaN) before the first step, so a hit on a block nothing computed shows.
"""

import argparse
import random

import pytest
import torch
from safetensors.torch import load_file
from test_prompt_adapters import SoftPromptOnLoRA

from adapters import LoRARequest, PromptAdapterRequest
from factories import save_prompt_adapter, save_tiny_model
from lora_runner import LLM, SamplingParams
from lora_runner.entrypoints.engine_args import add_engine_arguments, engine_config
from lora_runner.model import ModelConfig
from lora_runner.worker.kv_cache import kv_block_bytes

from engine_support import assert_exact, assert_idle, make_engine, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
LOGPROB_TOLERANCE = 1e-5  # CPU fp32: a cached block holds the KV the same prefill computed
rng = random.Random(0)
SYSTEM = [rng.randrange(3, 256) for _ in range(10)]  # a shared system prompt: 2 full blocks of 4 and 2 tokens


def tokens(n, seed):
    r = random.Random(seed)
    return [r.randrange(3, 256) for _ in range(n)]


def assert_same(on, off, tolerance=LOGPROB_TOLERANCE):
    """Caching on and off gave every request the same tokens and (within tolerance) logprobs."""
    assert on.keys() == off.keys()
    for request_id in on:
        for a, b in zip(on[request_id].outputs, off[request_id].outputs, strict=True):
            assert a.finish_reason == b.finish_reason == "length", (request_id, a.error, b.error)
            assert a.token_ids == b.token_ids, request_id
            for step, token in enumerate(a.token_ids):
                assert abs(a.logprobs[step][token] - b.logprobs[step][token]) <= tolerance, (request_id, step)


def chat_rounds(engine, first_turns, num_turns, per_step=None):
    """Multi-turn chats: each turn's prompt is the previous prompt + its reply + a new user message."""
    done, prompts = {}, dict(first_turns)
    for turn in range(num_turns):
        ids = {f"{chat}-t{turn}": chat for chat in prompts}
        requests = [(request_id, prompts[chat], GREEDY) for request_id, chat in ids.items()]
        run_to_completion(engine, requests, per_step=per_step, done=done)
        prompts = {chat: prompts[chat] + done[request_id].outputs[0].token_ids + tokens(3, hash((chat, turn)) % 997)
                   for request_id, chat in ids.items()}
    return done


def workload(engine):
    """Shared system prompt, multi-turn chats, prompts that are prefixes of each other, exactly one
    block long and one token past one, n > 1, arriving a few per step."""
    singles = [("one-block", SYSTEM[:4]), ("one-past", SYSTEM[:5]), ("two-blocks", SYSTEM[:8]),
               ("system", SYSTEM), ("prefix-a", SYSTEM + tokens(3, 1)), ("prefix-ab", SYSTEM + tokens(3, 1) + [9, 9]),
               ("other", tokens(9, 2)), ("one-block-again", SYSTEM[:4]), ("one-past-again", SYSTEM[:5])]
    done = run_to_completion(engine, [(i, p, GREEDY) for i, p in singles], per_step=2)
    parallel = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1, n=3)
    run_to_completion(engine, [("n3", SYSTEM + [5, 6, 7], parallel), ("n3-again", SYSTEM + [5, 6, 7], parallel)],
                      per_step=1, done=done)
    done.update(chat_rounds(engine, {f"chat{c}": SYSTEM + tokens(2 + c, 10 + c) for c in range(3)}, 3, per_step=2))
    return done, dict(singles)


@pytest.mark.parametrize("tight", [False, True], ids=["roomy", "tight-kv"])
def test_caching_on_equals_caching_off_and_the_oracle(engine_checkpoint, greedy_oracle, tight):
    path, hf, _ = engine_checkpoint
    # tight: 12 blocks of 4 for up to 4 requests of up to 30 tokens: running requests are preempted
    block = kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32)
    kv = dict(max_model_len=48, kv_cache_memory_bytes=12 * block) if tight else {}
    off = make_engine(path, enable_prefix_caching=False, poison=["kv_cache"], **kv)
    on = make_engine(path, poison=["kv_cache"], **kv)
    (done_off, _), (done_on, singles) = workload(off), workload(on)
    assert_same(done_on, done_off)
    if tight:
        assert on.scheduler.num_preemptions > 0
    for request_id, prompt in singles.items():
        assert_exact(done_on[request_id], hf, prompt, greedy_oracle, 4, tolerance=1e-4)
    cached = {request_id: output.num_cached_tokens for request_id, output in done_on.items()}
    assert all(output.num_cached_tokens == 0 for output in done_off.values())
    assert cached["one-block-again"] == 0  # the last token always computes
    assert sum(cached.values()) > 0 and on.stats.prefix_cache_hits > 0
    if not tight:  # nothing evicted: every repeat hits
        assert cached["one-past-again"] == 4 and cached["prefix-ab"] >= 8 and cached["n3-again"] == 12
        assert all(cached[f"chat{c}-t2"] >= 12 for c in range(3))  # earlier turns, replies included, were cached
    assert on.stats.kv_blocks_cached > 0
    assert off.stats.prefix_cache_hits == 0 and off.stats.kv_blocks_cached == 0
    for engine in (on, off):
        assert_idle(engine)


def test_sliding_window_layers_reuse_exactly(tmp_path, greedy_oracle):
    """Our paged sliding-window attention keeps every block and masks the window, so a cached block
    reads the same later: caching stays on for windowed models (Mistral, window 5 < the prompts)."""
    hf = save_tiny_model(tmp_path / "mistral", "mistral", seed=3, sliding_window=5)
    off = make_engine(str(tmp_path / "mistral"), enable_prefix_caching=False, poison=["kv_cache"])
    on = make_engine(str(tmp_path / "mistral"), poison=["kv_cache"])
    assert on.block_manager.enable_caching
    prompts = {"a": SYSTEM + [7, 8, 9], "b": SYSTEM + [7, 8, 9, 10, 11], "c": SYSTEM[:9]}
    requests = [(i, p, GREEDY) for i, p in prompts.items()]
    done_off = run_to_completion(off, requests, per_step=1)
    done_on = run_to_completion(on, requests, per_step=1)
    assert_same(done_on, done_off)
    assert done_on["b"].num_cached_tokens == 12 and done_on["c"].num_cached_tokens == 8
    for request_id, prompt in prompts.items():
        assert_exact(done_on[request_id], hf, prompt, greedy_oracle, 4)


@pytest.fixture(scope="module")
def identities(engine_checkpoint, tmp_path_factory):
    """name -> (lora_request, prompt_adapter_request, salt, oracle model) for one prompt under every identity."""
    path, hf, loras = engine_checkpoint
    root = tmp_path_factory.mktemp("prefix-soft-prompt")
    soft = save_prompt_adapter(hf, root / "p", num_virtual_tokens=4, seed=21)
    embeddings = load_file(f"{root / 'p'}/adapter_model.safetensors")["prompt_embeddings"]
    a_old, a_new, b = LoRARequest("A", loras["r4"][0]), LoRARequest("A", loras["r16-mlp"][0]), \
        LoRARequest("B", loras["r8-qv"][0])
    p = PromptAdapterRequest("P", str(root / "p"))
    return {"A": (a_old, None, None, loras["r4"][1]), "B": (b, None, None, loras["r8-qv"][1]),
            "none": (None, None, None, hf), "P": (None, p, None, soft),
            "P+A": (a_old, p, None, SoftPromptOnLoRA(hf, loras["r4"][0], embeddings)),
            "salt1": (None, None, "s1", hf), "salt2": (None, None, "s2", hf),
            "A-replaced": (a_new, None, None, loras["r16-mlp"][1])}


def test_only_identical_lora_version_prompt_adapter_and_salt_hit(engine_checkpoint, greedy_oracle, identities):
    path, _, _ = engine_checkpoint
    engine = make_engine(path, max_prompt_adapters=1, max_prompt_adapter_tokens=8, poison=["kv_cache"])
    prompt = SYSTEM + [11, 12, 13]  # 13 tokens: 3 blocks may be cached (12 tokens; 4 of them placeholders with P)
    order = ["A", "B", "none", "P", "P+A", "salt1", "salt2", "A-replaced"]  # "A" is replaced before the last
    for name in order:
        lora, soft, salt, model = identities[name]
        if name == "A-replaced":
            engine.add_lora(lora)  # the same name, new files: a new version
        for attempt in ("first", "again"):
            request_id = f"{name}-{attempt}"
            engine.add_request(request_id, prompt, GREEDY, lora_request=lora, prompt_adapter_request=soft,
                               cache_salt=salt)
            output = run_to_completion(engine)[request_id]
            want = 0 if attempt == "first" else 12
            assert output.num_cached_tokens == want, (request_id, output.num_cached_tokens)
            assert_exact(output, model, prompt, greedy_oracle, 4)  # cached KV of another identity would change them
    assert_idle(engine)


def test_a_flood_of_distinct_long_prompts_evicts_but_changes_and_fails_no_one(engine_checkpoint):
    path, _, _ = engine_checkpoint
    block = kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32)
    outputs = {}
    for caching in (False, True):
        engine = make_engine(path, enable_prefix_caching=caching, kv_cache_memory_bytes=16 * block,
                             poison=["kv_cache"])
        requests = []
        for i in range(12):  # a victim chat request with the shared system prompt after every 2 flood ones
            requests.append((f"flood{i}", tokens(30, 100 + i), GREEDY))
            if i % 2:
                requests.append((f"victim{i}", SYSTEM + [i + 3], GREEDY))
        # 16 blocks, the whole cache: only evicting every cached block makes room for it
        requests.append(("whole-cache", tokens(60, 7), GREEDY))
        outputs[caching] = run_to_completion(engine, requests, per_step=1)
        assert_idle(engine)
        if caching:
            assert engine.stats.kv_blocks_cached <= 16 and engine.stats.prefix_cache_hits > 0
    assert_same(outputs[True], outputs[False])


def test_llm_generate_cache_salt_and_the_cli_switch(engine_checkpoint):
    path, _, _ = engine_checkpoint
    llm = LLM(path, device="cpu", max_model_len=64, block_size=4)
    try:
        prompt = SYSTEM + [4]
        params = SamplingParams(temperature=0.0, max_tokens=2)
        first, same, salted, salted_again = (
            llm.generate([prompt], params, cache_salt=salt, use_tqdm=False)[0] for salt in (None, None, "x", ["x"]))
        assert [o.num_cached_tokens for o in (first, same, salted, salted_again)] == [0, 8, 0, 8]
        assert same.outputs[0].token_ids == salted.outputs[0].token_ids == first.outputs[0].token_ids
        with pytest.raises(ValueError, match="cache_salt"):
            llm.generate([prompt], params, cache_salt=3, use_tqdm=False)
        with pytest.raises(ValueError, match="cache_salt"):
            llm.engine.add_request("bad-salt", prompt, params, cache_salt=b"x")
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.close()
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args([path])).enable_prefix_caching is True
    assert engine_config(parser.parse_args([path, "--no-enable-prefix-caching"])).enable_prefix_caching is False
