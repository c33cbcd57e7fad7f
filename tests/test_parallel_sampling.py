"""SamplingParams.n: n samples of one prompt sharing its prefill, reported as one RequestOutput."""

import pytest
import torch

from lora_runner import LLM, LLMEngine, SamplingParams
from lora_runner.model import ModelConfig
from lora_runner.worker.kv_cache import kv_block_bytes

PROMPT = list(range(5, 14))  # 9 tokens: two full blocks of 4 to share, the last token computed per sample


def sampled(max_tokens=6, **kwargs):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    path, _, _ = engine_checkpoint
    return LLM(path, device="cpu", max_num_seqs=6, max_model_len=64, block_size=4)


def assert_idle(engine):
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("bad", [0, 17, True, 1.0, None])
def test_bad_n_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=bad)


def test_seeded_samples_are_reproducible_and_equal_single_requests(llm, engine_checkpoint):
    _, _, adapters = engine_checkpoint
    from adapters import LoRARequest

    lora = LoRARequest("r4", adapters["r4"][0])
    first, again = (llm.generate([PROMPT], sampled(n=3, seed=7), lora_request=lora, use_tqdm=False)[0]
                    for _ in range(2))
    assert first.finished and [c.index for c in first.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 6 for c in first.outputs)
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    singles = llm.generate([PROMPT] * 3, [sampled(seed=s) for s in (7, 8, 9)], lora_request=lora, use_tqdm=False)
    assert [c.token_ids for c in first.outputs] == [o.outputs[0].token_ids for o in singles]
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3  # different seeds, different samples
    assert_idle(llm.engine)


def test_seed_near_the_top_wraps():
    params = sampled(n=3, seed=2**64 - 2)
    assert [params.sample_params(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]  # 2**64 wraps to 0


def test_block_manager_fork_counts_references():
    from lora_runner.core.block_manager import BlockManager

    bm = BlockManager(8, 4)
    leader = list(bm.allocate("a", 10))  # 3 blocks
    assert bm.fork("a", "b", 2) == leader[:2] and bm.ref_count(leader[0]) == 2
    bm.allocate("b", 12)  # its own third block
    assert bm.num_used_blocks == 4
    with pytest.raises(RuntimeError):
        bm.fork("a", "b", 1)  # b holds blocks already
    with pytest.raises(RuntimeError):
        bm.fork("a", "c", 4)  # more than a holds
    assert bm.free("a") == 1 and bm.ref_count(leader[0]) == 1  # the shared two stay with b
    assert bm.free("b") == 3 and bm.num_free_blocks == 8 and bm.ref_count(leader[0]) == 0


def test_greedy_samples_are_identical_and_equal_the_oracle(llm, engine_checkpoint, greedy_oracle):
    _, hf, _ = engine_checkpoint
    out = llm.generate([PROMPT, [40, 41]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=4),
                       use_tqdm=False)
    for output, prompt in zip(out, [PROMPT, [40, 41]]):
        assert [c.index for c in output.outputs] == [0, 1, 2, 3]
        assert all(c.token_ids == greedy_oracle(hf, prompt, 5)[0] for c in output.outputs)
    assert_idle(llm.engine)


def test_samples_share_the_prompt_blocks(engine_checkpoint):
    path, _, _ = engine_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64, block_size=4)
    engine.add_request("g", PROMPT, sampled(n=3, seed=1, max_tokens=3))
    outputs = engine.step()  # the leader's prefill alone
    assert [o.request_id for o in outputs] == ["g"] and len(engine.scheduler.running) == 1
    engine.step()  # the other samples join, forking the leader's two full prompt blocks
    tables = [engine.block_manager.table(f"g[{i}]") for i in range(3)]
    assert tables[1][:2] == tables[2][:2] == tables[0][:2]
    assert all(engine.block_manager.ref_count(b) == 3 for b in tables[0][:2])
    assert len({b for t in tables for b in t[2:]}) == 3  # each computes the 9th prompt token in its own block
    assert engine.block_manager.num_used_blocks == 2 + 3  # the prompt allocated once
    done = [o for _ in range(10) for o in engine.step() if o.finished]
    assert len(done) == 1 and len(done[0].outputs) == 3 and all(len(c.token_ids) == 3 for c in done[0].outputs)
    assert_idle(engine)


def test_abort_frees_every_sample_and_ids_stay_taken_while_running(engine_checkpoint):
    path, _, _ = engine_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64, block_size=4)
    engine.add_request("g", PROMPT, sampled(n=3, max_tokens=20))
    engine.step(), engine.step()
    for taken in ("g", "g[2]"):
        with pytest.raises(ValueError, match="in use"):
            engine.add_request(taken, [5], sampled())
    engine.abort_request("g")
    (output,) = engine.step()
    assert output.request_id == "g" and output.finished
    assert [c.finish_reason for c in output.outputs] == ["abort"] * 3
    assert_idle(engine)
    engine.add_request("g", [5], sampled(max_tokens=1))  # the id is free again
    assert [o.request_id for o in engine.step()] == ["g"]


def test_samples_count_against_max_num_seqs_and_survive_preemption(engine_checkpoint, greedy_oracle):
    """Two sequences at once, and a KV cache too small for every sample: preempted samples
    recompute (sharing the leader's blocks again when it runs) and still match the oracle."""
    path, hf, _ = engine_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=24, block_size=4,
                       kv_cache_memory_bytes=7 * kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32))
    engine.add_request("a", PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    engine.add_request("b", [30, 31, 32], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2))
    done = {}
    while engine.has_unfinished_requests():
        assert len(engine.scheduler.running) <= 2
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert engine.scheduler.num_preemptions > 0
    for name, prompt, n in (("a", PROMPT, 3), ("b", [30, 31, 32], 2)):
        assert [c.token_ids for c in done[name].outputs] == [greedy_oracle(hf, prompt, 12)[0]] * n
    assert_idle(engine)


def test_leader_that_finishes_at_once_leaves_the_others_correct(llm, engine_checkpoint, greedy_oracle):
    """max_tokens=1: the leader is done (its blocks freed) before the others start; they prefill alone."""
    _, hf, _ = engine_checkpoint
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, n=3), use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [greedy_oracle(hf, PROMPT, 1)[0]] * 3
    assert_idle(llm.engine)


def test_a_sample_without_progress_in_a_step_repeats_no_text_delta():
    """Streams are built from text_delta: a sample that got no output in a step (admitted a step
    after its leader, or preempted) must report an empty delta, never its previous one again."""
    from lora_runner.outputs import CompletionOutput, RequestOutput
    from lora_runner.engine.parallel_sampling import SampleGroup
    from lora_runner.core.request import Request

    samples = [Request(f"r[{i}]", [1, 2], SamplingParams(max_tokens=4), arrival=i) for i in range(2)]
    group = SampleGroup("r", samples)

    def step(index, tokens, delta):
        group.update(index, RequestOutput(f"r[{index}]", [1, 2], [CompletionOutput(0, tokens, text_delta=delta)]))

    step(0, [5], "a")
    step(1, [6], "b")
    assert [c.text_delta for c in group.output().outputs] == ["a", "b"]
    step(0, [5, 7], "c")  # sample 1 made no progress this step
    merged = group.output()
    assert [c.text_delta for c in merged.outputs] == ["c", ""]
    assert [c.token_ids for c in merged.outputs] == [[5, 7], [6]] and [c.index for c in merged.outputs] == [0, 1]
