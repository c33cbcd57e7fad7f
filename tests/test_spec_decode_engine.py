"""Speculative decoding end to end: with n-gram drafts, greedy requests across a mixed batch of
adapters (base, LoRAs of two ranks, DoRA, a soft prompt, embed_tokens / lm_head LoRA) get exactly
the tokens and logprobs they get without speculation (prefix caching on, chunked prefill, a KV cache
tight enough to preempt, stop strings, n = 2, penalised / min_tokens / bad-words requests beside
them, tp = 2), and seeded sampled requests keep their tokens."""

from __future__ import annotations

import math
import random

import pytest
import torch

from adapters import LoRARequest, PromptAdapterRequest
from engine_support import run_to_completion
from factories import save_lora, save_prompt_adapter
from lora_runner import LLMEngine, SamplingParams
from lora_runner.model import ModelConfig
from lora_runner.worker.draft_runner import draft_kv_blocks
from lora_runner.worker.kv_cache import kv_block_bytes

NUM_BLOCKS = 24  # 4 requests of ~40 tokens need ~40 blocks of 4: preemption
KINDS = ("base", "r4", "r8-rslora", "dora", "soft-prompt", "vocab")  # mixed in every step
# settings whose logits change per position: verified with the drafts before each position counted
GREEDY_EXTRAS = {3: dict(repetition_penalty=1.3, frequency_penalty=0.2), 5: dict(min_tokens=8, stop_token_ids=[7]),
                 7: dict(bad_words=["w100 w101", "w7"])}


def ngram(k: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def grounded_prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a short motif (input-grounded: n-gram drafts find matches); prompt i and
    i + n/2 share a prefix, and the later one comes when the earlier one's blocks are cached."""
    rng = random.Random(seed)
    short, long = [], []
    for _ in range(n // 2):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(3, 5))]
        short.append((motif * 8)[:rng.randint(16, 22)])
        long.append((motif * 8)[:rng.randint(23, 28)])
    return short + long


@pytest.fixture(scope="module")
def checkpoint(engine_checkpoint, tmp_path_factory):
    """(model dir, request id -> its adapter requests) with a DoRA and a soft prompt added."""
    path, hf, adapters = engine_checkpoint
    root = tmp_path_factory.mktemp("spec")
    save_lora(hf, root / "dora", seed=7, r=4, lora_alpha=8, use_dora=True, scale=0.15)
    save_prompt_adapter(hf, root / "soft", num_virtual_tokens=4, seed=7, scale=0.5)
    save_lora(hf, root / "vocab", seed=8, r=8, lora_alpha=16, scale=0.15,  # its lm_head LoRA: per verified position
              target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"])
    requests = {"base": {}, "soft-prompt": {"prompt_adapter_request": PromptAdapterRequest("soft", str(root / "soft"))},
                "dora": {"lora_request": LoRARequest("dora", str(root / "dora"))},
                "vocab": {"lora_request": LoRARequest("vocab", str(root / "vocab"))}}
    for name in ("r4", "r8-rslora"):
        requests[name] = {"lora_request": LoRARequest(name, adapters[name][0])}
    return path, requests


def kv_cache_bytes(path: str, spec: dict | None) -> int:
    """kv_cache_memory_bytes for NUM_BLOCKS of the model's blocks, and a draft model's KV cache beside them
    (it shares the setting: lora_runner.executor.draft_budget), so every run preempts alike."""
    target = kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32)
    if spec is None or spec["method"] != "draft_model":
        return NUM_BLOCKS * target
    draft = kv_block_bytes(ModelConfig.from_dir(spec["model"]), 4, torch.float32)
    return NUM_BLOCKS * target + draft_kv_blocks(NUM_BLOCKS, max_num_seqs=4, k=spec["num_speculative_tokens"],
                                                 block_size=4) * draft


def run(checkpoint, spec, prompts, stop_words=(), seeded=False, tp=1):
    """Finished outputs {index: RequestOutput} and the engine, requests added two per step."""
    path, adapter_requests = checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64, block_size=4, max_loras=2,
                       max_prompt_adapters=1, max_prompt_adapter_tokens=4,
                       max_logprobs=3, max_num_batched_tokens=16, enable_prefix_caching=True,
                       kv_cache_memory_bytes=kv_cache_bytes(path, spec),
                       speculative_config=spec, tensor_parallel_size=tp, cpu_threads=1)
    for kind in adapter_requests.values():  # loaded before the first step: which step an adapter's first
        if "lora_request" in kind:  # request joins must not follow a background load's timing
            engine.add_lora(kind["lora_request"])
        if "prompt_adapter_request" in kind:
            engine.add_prompt_adapter(kind["prompt_adapter_request"])
    requests = []
    for i, prompt in enumerate(prompts):
        params = (SamplingParams(temperature=0.3, top_k=40, seed=100 + i, max_tokens=16, ignore_eos=True)
                  if seeded else
                  SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2,
                                 stop=list(stop_words) if i % 2 == 0 else [], n=2 if i == 1 else 1,
                                 **GREEDY_EXTRAS.get(i, {})))
        kind = adapter_requests[KINDS[i % len(KINDS)]]
        requests.append((f"r{i}", prompt, params, kind.get("lora_request"), kind.get("prompt_adapter_request")))
    done = run_to_completion(engine, requests, per_step=2)
    done = {int(request_id[1:]): output for request_id, output in done.items()}
    engine.close()
    return done, engine


@pytest.fixture(scope="module")
def plain(checkpoint):
    """The run without speculation, and a stop word its first request generates mid-way."""
    prompts = grounded_prompts(12, seed=5)
    reference, engine = run(checkpoint, None, prompts)
    stop = engine.tokenizer.decode([reference[0].outputs[0].token_ids[8]]).strip()
    done, engine = run(checkpoint, None, prompts, stop_words=[stop])
    return prompts, stop, done, engine


def assert_same_completion(want, got, label: str) -> None:
    """Same tokens, text and finish reason, and logprobs within 1e-5 relative: a verified token ran in a
    multi-token query, the prefill attention path, so float32 sums differ in order from the one-token
    decode (seen: 9.1e-6 relative, -1.98196 vs -1.98197 at the 16th token). run() loads the adapters before
    the first step: when a background load finished decided which step a request joined, so GEMM shapes
    differed from process to process (2.0e-5 seen then)."""
    assert got.token_ids == want.token_ids, label
    assert (got.text, got.finish_reason) == (want.text, want.finish_reason), label
    for position, (a, b) in enumerate(zip(want.logprobs, got.logprobs, strict=True)):
        assert a.keys() == b.keys(), f"{label} token {position}"
        assert all(math.isclose(a[t], b[t], rel_tol=1e-5, abs_tol=1e-5) for t in a), (label, position, a, b)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_speculation_equals_greedy_without(checkpoint, plain, k):
    prompts, stop, expected, plain_engine = plain
    done, engine = run(checkpoint, ngram(k), prompts, stop_words=[stop])
    assert plain_engine.scheduler.num_preemptions > 0 and engine.scheduler.num_preemptions > 0
    assert engine.stats.prefix_cache_hits > 0
    assert expected[0].outputs[0].finish_reason == "stop"  # the stop word cut a request
    assert len(expected[1].outputs) == len(done[1].outputs) == 2  # n = 2: forked samples speculate too
    for i in range(len(prompts)):
        for want, got in zip(expected[i].outputs, done[i].outputs, strict=True):
            assert_same_completion(want, got, f"request {i} sample {want.index}")
    # penalties, min_tokens, bad words: verified per position like the rest (tests/test_spec_decode_rows.py)
    assert sum(done[i].spec_decode.num_drafts for i in (3, 5, 7)) > 0
    assert done[11].spec_decode.num_drafts > 0  # the lm_head LoRA adapter's request verified drafts
    spec = engine.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, "both paths: some drafts accepted, some rejected"
    per_request = [done[i].spec_decode for i in done if len(done[i].outputs) == 1]  # n = 2 merged: none
    assert 0 < sum(s.num_draft_tokens for s in per_request) <= spec.num_draft_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens and len(spec.accepted_per_position) == k
    blocks = engine.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.holders() == []
    assert plain_engine.stats.spec_decode is None and expected[0].spec_decode is None


def test_tensor_parallel_ranks_verify_alike(checkpoint, plain):
    """At tp=2 every rank verifies the same drafts to the same tokens (the executor checks each step)."""
    prompts, stop, expected, _ = plain
    done, engine = run(checkpoint, ngram(3), prompts, stop_words=[stop], tp=2)
    for i in range(len(prompts)):
        for want, got in zip(expected[i].outputs, done[i].outputs, strict=True):
            assert_same_completion(want, got, f"request {i} sample {want.index}")
    assert engine.stats.spec_decode.num_accepted_tokens > 0


def test_seeded_sampling_keeps_its_tokens_with_speculation(checkpoint):
    """A seeded request's k-th token uses the k-th draws of its generator, speculating or not (the
    verifier rewinds past the positions it did not keep): the same tokens as without speculation,
    whatever else is batched."""
    prompts = grounded_prompts(12, seed=5)
    plain, _ = run(checkpoint, None, prompts, seeded=True)
    first, engine = run(checkpoint, ngram(3), prompts, seeded=True)
    tokens = {i: o.outputs[0].token_ids for i, o in plain.items()}
    assert {i: o.outputs[0].token_ids for i, o in first.items()} == tokens
    spec = engine.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
