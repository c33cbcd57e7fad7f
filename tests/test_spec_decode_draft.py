"""Speculative decoding with a draft model: its KV bookkeeping without a model (a fake draft whose next
token is a function of the context it reads back from its paged cache), then end to end with tiny
checkpoints: greedy requests across the mixed batch of adapters of test_spec_decode_engine (two LoRA
ranks, DoRA, a soft prompt, an lm_head LoRA, base; n = 2, prefix caching, preemption, stop strings)
get exactly the tokens and logprobs of the run without speculation for k in {1, 3, 5}; a draft equal
to the target proposes what the target decodes (every draft of a base request accepted); seeded
requests keep their tokens; sampled tokens keep their distribution; a draft of another vocabulary is
refused."""

from __future__ import annotations

import json
import random
import shutil

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from test_spec_decode_engine import KINDS, assert_same_completion, checkpoint, grounded_prompts, plain, run

from factories import MICRO_LLAMA, build_tiny_model, save_tiny_model, save_tiny_tokenizer
from lora_runner import LLMEngine, SamplingParams
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.spec_decode.adaptive import SpeculationPolicy
from lora_runner.spec_decode.config import SpeculativeConfig
from lora_runner.spec_decode.draft_model import DraftModelSpeculator

__all__ = ["checkpoint", "plain"]  # module fixtures shared with the n-gram tests


def draft_model(path, k: int) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k}


# ------------------------------------------------------------------ bookkeeping, without a model
def next_token(context) -> int:
    """The fake draft's greedy token after `context`: depends on every token and its position."""
    return int(sum((i + 1) * int(t) for i, t in enumerate(context)) % 11) + 3


class FakeDraft:
    """A DraftForward whose 'KV cache' holds token ids per slot: it writes each chunk's tokens, then
    predicts from the context it reads back through the block table. A slot that holds a stale token
    (a rollback missed) or a chunk at the wrong position gives another token than next_token(true context)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv = np.full(num_blocks * block_size, -1)
        self.block_size = block_size
        self.calls = []  # per forward: its chunks

    def _slot(self, table, position: int) -> int:
        return table[position // self.block_size] * self.block_size + position % self.block_size

    def __call__(self, chunks):
        self.calls.append(list(chunks))
        tokens = []
        for c in chunks:
            for position in range(c.start, c.start + c.num_new_tokens):
                self.kv[self._slot(c.block_table, position)] = c.token_ids[position]
            if c.sample:
                end = c.start + c.num_new_tokens
                tokens.append(next_token([self.kv[self._slot(c.block_table, p)] for p in range(end)]))
        return tokens


def oracle(tokens: list[int], n: int) -> list[int]:
    out = list(tokens)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(tokens):]


class _Target:
    """The verifying model, faked: keeps a random number of a row's drafts, then a token of its own. As
    an OutputProcessor it appends every token and never stops (the test finishes requests at max_tokens)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def verify(self, drafts) -> list[int]:
        return list(drafts[:self.rng.randint(0, len(drafts))]) + [self.rng.randrange(3, 50)]

    def append(self, request, tokens, logprobs):
        request.token_ids += tokens

    def finish(self, request, reason):
        return reason


@pytest.mark.parametrize("k", [1, 3, 5])
def test_draft_cache_holds_exactly_the_accepted_tokens_before_each_proposal(k):
    """Chunked prefill, rejected and accepted drafts, drafts the budget drops, and preemption (a tight
    target pool): every proposal is the fake draft's greedy continuation of the request's true tokens,
    each step runs at most k draft forwards with every proposing row in each, and every draft block is
    free at the end."""
    blocks = BlockManager(64, 4)
    fake = FakeDraft(64, 4)
    config = SpeculativeConfig.parse(draft_model("fake", k))
    speculator = DraftModelSpeculator(config, fake, blocks, max_model_len=64, max_num_tokens=16)
    scheduler = Scheduler(BlockManager(14, 4), max_num_seqs=4, max_num_batched_tokens=12, max_loras=1,
                          adapter_state=lambda ref: "ready", speculator=SpeculationPolicy(speculator, config))
    rng = random.Random(k)
    requests = [Request(f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randint(5, 15))],
                        SamplingParams(temperature=0.0, max_tokens=14), arrival=i) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    target, checked, steps = _Target(k), 0, 0
    while scheduler.has_unfinished():
        num_calls = len(fake.calls)
        out = scheduler.schedule()
        steps += 1
        step_calls = fake.calls[num_calls:]
        assert len(step_calls) <= k
        proposing = sum(c.sample for c in step_calls[0]) if step_calls else 0
        for later in step_calls[1:]:  # one token per proposing row, all of them in one forward
            assert all(c.num_new_tokens == 1 and c.sample for c in later) and len(later) <= proposing
        sampled = []
        for s in out.scheduled:
            request = s.request
            if s.draft_token_ids:
                assert list(s.draft_token_ids) == oracle(request.token_ids, len(s.draft_token_ids))
                checked += 1
            if s.samples:
                sampled.append(target.verify(s.draft_token_ids))
        result = SamplerOutput(sampled, [[None] * len(tokens) for tokens in sampled])
        for request, _ in scheduler.postprocess(out.scheduled, result, target):
            if request.num_output_tokens >= request.params.max_tokens and not request.is_finished:
                request.finish("length")
                scheduler.remove(request)
    assert checked > steps // 3 and scheduler.num_preemptions > 0
    assert blocks.num_free_blocks == blocks.num_blocks and blocks.holders() == []


def test_a_failing_draft_forward_costs_only_that_steps_proposals():
    blocks = BlockManager(16, 4)
    fake = FakeDraft(16, 4)
    calls = []

    def flaky(chunks):
        calls.append(len(chunks))
        if len(calls) == 2:
            raise RuntimeError("draft broke")
        return fake(chunks)
    speculator = DraftModelSpeculator(SpeculativeConfig.parse(draft_model("fake", 3)), flaky, blocks,
                                      max_model_len=64, max_num_tokens=16)
    request = Request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, max_tokens=10), arrival=0)
    request.num_computed_tokens = 4  # decoding: its last token is uncomputed
    speculator.prepare([request])  # the first forward works, the second raises
    assert speculator.drafts(request, budget=10) == [] and blocks.holders() == []
    speculator.prepare([request])  # it starts over from the request's tokens
    assert speculator.drafts(request, budget=10) == oracle(request.token_ids, 3)
    assert speculator.drafts(request, budget=2) == oracle(request.token_ids, 1)  # cut to the step's budget
    speculator.release(request)
    assert blocks.num_free_blocks == blocks.num_blocks


# ------------------------------------------------------------------ end to end, tiny checkpoints
@pytest.fixture(scope="module")
def drafts(engine_checkpoint, tmp_path_factory):
    """Draft dirs: "target" (the model itself), "truncated" (its first layer, embeddings and head: a
    smaller, correlated draft), "qwen2" (another family, half the hidden size, one layer, the same
    tokenizer), "vocab-300" and "other-ids" (refused)."""
    path, hf, _ = engine_checkpoint
    root = tmp_path_factory.mktemp("drafts")
    truncated = build_tiny_model("llama", seed=0, num_hidden_layers=1)
    missing, _ = truncated.load_state_dict(hf.state_dict(), strict=False)  # layer 1 of the target is left out
    assert not missing
    truncated.save_pretrained(str(root / "truncated"))
    save_tiny_tokenizer(root / "truncated", 256)
    save_tiny_model(root / "qwen2", "qwen2", seed=3, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    save_tiny_model(root / "vocab-300", "llama", seed=3, vocab_size=300, num_hidden_layers=1)
    shutil.copytree(root / "truncated", root / "other-ids")
    tokenizer = json.loads((root / "other-ids" / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (root / "other-ids" / "tokenizer.json").write_text(json.dumps(tokenizer))
    return {"target": path, **{name: str(root / name) for name in ("truncated", "qwen2", "vocab-300", "other-ids")}}


def assert_all_same(expected, done, label):
    """Same completions as `expected`, for every request and sample."""
    for i in expected:
        for want, got in zip(expected[i].outputs, done[i].outputs, strict=True):
            assert_same_completion(want, got, f"{label}: request {i} sample {want.index}")


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_with_a_draft_model_equals_greedy_without(checkpoint, plain, drafts, k, caplog):
    prompts, stop, expected, _ = plain
    done, engine = run(checkpoint, draft_model(drafts["truncated"], k), prompts, stop_words=[stop])
    assert engine.scheduler.num_preemptions > 0 and engine.stats.prefix_cache_hits > 0
    assert len(done[1].outputs) == 2  # n = 2: forked samples speculate too
    assert_all_same(expected, done, f"k={k}")
    assert done[3].spec_decode.num_drafts > 0 and done[7].spec_decode.num_drafts > 0  # penalties, bad words too
    spec = engine.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, "both paths: some drafts accepted, some rejected"
    assert len(spec.accepted_per_position) == k
    speculator = engine.scheduler.speculator.proposer  # the policy's (spec_decode.adaptive)
    assert speculator.num_forwards > 0
    assert not [r for r in caplog.records if "draft" in r.name and r.levelname == "WARNING"], "a draft forward failed"
    for pool in (engine.block_manager, speculator.block_manager):  # the target's and the draft's own
        assert pool.num_free_blocks == pool.num_blocks and pool.holders() == []


def test_a_draft_equal_to_the_target_proposes_what_the_target_decodes(checkpoint, plain, drafts, caplog):
    """Draft = target: every draft of a base request is accepted (its KV holds exactly the accepted
    tokens before each proposal, at the right positions); adapter requests, whose target is the
    adapted model, still get exactly their tokens."""
    prompts, stop, expected, _ = plain
    done, engine = run(checkpoint, draft_model(drafts["target"], 3), prompts, stop_words=[stop])
    assert_all_same(expected, done, "draft = target")
    assert not [r for r in caplog.records if "draft" in r.name and r.levelname == "WARNING"]
    base = [i for i in done if KINDS[i % len(KINDS)] == "base"]
    assert base
    for i in base:
        spec = done[i].spec_decode
        assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens == spec.num_draft_tokens, (i, spec)


def test_a_smaller_draft_of_another_family(checkpoint, plain, drafts):
    prompts, stop, expected, _ = plain
    done, engine = run(checkpoint, draft_model(drafts["qwen2"], 3), prompts, stop_words=[stop])
    assert_all_same(expected, done, "qwen2 draft")
    assert engine.stats.spec_decode.num_draft_tokens > 0


def test_tensor_parallel_target_with_the_draft_on_the_engine_side(checkpoint, plain, drafts):
    """At tp=2 the target's ranks verify; the draft runs unsharded in the engine's process."""
    prompts, stop, expected, _ = plain
    done, engine = run(checkpoint, draft_model(drafts["truncated"], 3), prompts, stop_words=[stop], tp=2)
    assert_all_same(expected, done, "tp=2")
    assert engine.stats.spec_decode.num_accepted_tokens > 0 and engine.scheduler.speculator.proposer.num_forwards > 0


def test_seeded_sampling_keeps_its_tokens_with_a_draft_model(checkpoint, drafts):
    prompts = grounded_prompts(12, seed=5)
    without, _ = run(checkpoint, None, prompts, seeded=True)
    done, engine = run(checkpoint, draft_model(drafts["truncated"], 3), prompts, seeded=True)
    assert {i: o.outputs[0].token_ids for i, o in done.items()} == {i: o.outputs[0].token_ids
                                                                    for i, o in without.items()}
    spec = engine.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_sampled_tokens_keep_their_distribution(tmp_path):
    """Unseeded sampling (the engine's generator) on a 32-token vocabulary: the tokens at output
    positions 1..3 (after verified drafts) are distributed alike with and without a draft model
    (chi-square of the two histograms)."""
    save_tiny_model(tmp_path / "micro", "llama", seed=1, tokenizer=False, initializer_range=0.5, **MICRO_LLAMA)

    def histograms(spec):
        engine = LLMEngine(str(tmp_path / "micro"), device="cpu", max_num_seqs=128, max_model_len=32, block_size=4,
                           speculative_config=spec, seed=11 if spec else 7)
        params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
        for i in range(512):
            engine.add_request(f"r{i}", [5, 9, 3, 7], params)
        tokens = []
        while engine.has_unfinished_requests():
            tokens += [o.outputs[0].token_ids for o in engine.step() if o.finished]
        return np.asarray(tokens), engine
    plain_tokens, _ = histograms(None)
    spec_tokens, engine = histograms(draft_model(tmp_path / "micro", 3))
    assert engine.stats.spec_decode.num_accepted_tokens > 150
    for position in (1, 2, 3):
        table = np.stack([np.bincount(plain_tokens[:, position], minlength=32),
                          np.bincount(spec_tokens[:, position], minlength=32)])
        table = table[:, table.sum(axis=0) > 0]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


@pytest.mark.parametrize("name, message", [("vocab-300", "its vocab_size is 300, the model's 256"),
                                           ("other-ids", "maps 2 tokens to other ids")])
def test_a_draft_with_another_vocabulary_is_refused(engine_checkpoint, drafts, name, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(engine_checkpoint[0], device="cpu", max_model_len=64, speculative_config=draft_model(drafts[name], 2))
