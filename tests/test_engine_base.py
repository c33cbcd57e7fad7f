"""LLMEngine on the base model against transformers: logprobs, greedy tokens, chunked prefill,
preemption, staggered arrivals, stop conditions, seeds, aborts, bad requests, threads."""

import random
import threading

import pytest
import torch

from factories import save_tiny_model
from lora_runner import LLMEngine, SamplingParams
from lora_runner.model import ModelConfig
from lora_runner.worker.kv_cache import kv_block_bytes

VOCAB = 256


def make_prompts(n, seed=0, lo=3, hi=20):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_staggered(engine, prompts, params, per_step=2, prefix="r"):
    """Add `per_step` requests before each step; returns {index: final RequestOutput}."""
    pending = list(enumerate(prompts))
    done = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(per_step):
            if pending:
                i, prompt = pending.pop(0)
                engine.add_request(f"{prefix}{i}", prompt, params[i] if isinstance(params, list) else params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id[len(prefix):])] = out
    return done


def assert_all_blocks_free(engine):
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.holders() == []
    assert not engine.scheduler.has_unfinished() and not engine.has_unfinished_requests()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def arch_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), save_tiny_model(path, request.param, seed=3, tokenizer=False)


def test_logprobs_and_tokens_match_transformers(arch_checkpoint):
    """Prefill + step-by-step decode: every generated step's full log-softmax row equals transformers'."""
    path, hf = arch_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=128, block_size=4, max_logprobs=VOCAB)
    prompts = make_prompts(5, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=VOCAB)
    done = run_staggered(engine, prompts, params)
    for i, prompt in enumerate(prompts):
        completion = done[i].outputs[0]
        tokens = completion.token_ids
        assert len(tokens) == 6 and completion.finish_reason == "length" and done[i].prompt_token_ids == prompt
        with torch.inference_mode():  # teacher-forced on our tokens: one forward gives every step's logits
            logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].double()  # [6, V]
        want = torch.log_softmax(logits, -1)
        got = torch.tensor([[step[t] for t in range(VOCAB)] for step in completion.logprobs], dtype=torch.float64)
        assert (got - want).abs().max().item() <= 1e-4, (i, (got - want).abs().max(-1).values)
        assert tokens == want.argmax(-1).tolist()
    assert engine.runner.lora_meta.num_tokens is None  # no adapter: the LoRA path never ran
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-tok")
    return str(path), save_tiny_model(path, "llama", seed=0, tokenizer=True)


def test_chunked_prefill_and_preemption_match_unconstrained(llama_dir, greedy_oracle):
    path, hf = llama_dir
    prompts = make_prompts(6, seed=2, lo=5, hi=30)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # 8 tokens per step forces chunked prefill; 14 blocks of 4 tokens cannot hold 4 requests of ~40 tokens
    tight = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=48, block_size=4,
                      max_num_batched_tokens=8,
                      kv_cache_memory_bytes=14 * kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32))
    assert tight.block_manager.num_blocks == 14
    done = run_staggered(tight, prompts, params, per_step=3)
    assert tight.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert done[i].outputs[0].token_ids == greedy_oracle(hf, prompt, 8)[0]
    assert_all_blocks_free(tight)


def test_string_prompts_use_the_tokenizer(llama_dir, greedy_oracle):
    path, hf = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=64)
    engine.add_request("s", "the cat sat on the mat", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = [o for _ in range(10) for o in engine.step() if o.finished]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode("the cat sat on the mat")
    assert outs[0].prompt_token_ids == ids and outs[0].prompt == "the cat sat on the mat"
    tokens = outs[0].outputs[0].token_ids
    assert tokens == greedy_oracle(hf, ids, 5)[0]
    assert outs[0].outputs[0].text == tok.decode(tokens, skip_special_tokens=True) != ""


def test_no_tokenizer_token_prompts_only(arch_checkpoint):
    path, _ = arch_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ValueError, match="pass the prompt as a list of token ids"):
        engine.add_request("a", "hello world")
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=2))
    outs = [o for _ in range(5) for o in engine.step() if o.finished]
    assert outs[0].outputs[0].text == "" and len(outs[0].outputs[0].token_ids) == 2


def test_bad_requests_raise_and_engine_stays_usable(llama_dir):
    path, _ = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=16)
    engine.add_request("x", [5, 6], SamplingParams(temperature=0, max_tokens=3))
    for args, match in [(("e", []), "empty"), (("l", list(range(3, 20))), "max_model_len"),
                        (("x", [5]), "already in use"), (("v", [5, VOCAB]), "vocabulary"),
                        (("p", [5], "greedy"), "SamplingParams"), (("q", 5), "prompt must be")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args)
    outs = [o for _ in range(5) for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["x"] and len(outs[0].outputs[0].token_ids) == 3
    engine.add_request("x", [5, 6], SamplingParams(max_tokens=1))  # a finished id may be reused
    assert [o.request_id for o in engine.step() if o.finished] == ["x"]
    assert_all_blocks_free(engine)


def test_stop_tokens_eos_and_max_model_len(llama_dir, greedy_oracle):
    path, hf = llama_dir
    prompt = make_prompts(1, seed=5, lo=6, hi=6)[0]
    tokens = greedy_oracle(hf, prompt, 8)[0]
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=10)
    stop_at = tokens.index(tokens[3])
    engine.add_request("stop", prompt, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[tokens[3]],
                                                      ignore_eos=True))
    engine.add_request("len", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.eos_token_ids = frozenset({tokens[2]})
    engine.add_request("eos", prompt, SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("ign", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    done = {o.request_id: o.outputs[0] for _ in range(20) for o in engine.step() if o.finished}
    assert (done["stop"].token_ids, done["stop"].finish_reason) == (tokens[:stop_at + 1], "stop")
    assert (done["len"].token_ids, done["len"].finish_reason) == (tokens[:4], "length")  # 6 + 4 = max_model_len
    eos_at = tokens.index(tokens[2])
    assert (done["eos"].token_ids, done["eos"].finish_reason) == (tokens[:eos_at + 1], "stop")
    assert (done["ign"].token_ids, done["ign"].finish_reason) == (tokens[:3], "length")


def test_seeded_sampling_reproduces_whatever_the_batch(llama_dir):
    path, _ = llama_dir
    prompt = [5, 9, 17, 33]
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64)
    alone = run_staggered(engine, [prompt], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = run_staggered(engine, [[7, 8], prompt, [40, 41, 42]], [others, seeded, others], per_step=1)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=12, ignore_eos=True)
    assert run_staggered(engine, [prompt], other_seed)[0].outputs[0].token_ids != alone


def test_abort_running_and_waiting_frees_everything(llama_dir):
    path, _ = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", [5 + i, 6, 7], params)
    engine.step()
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    engine.abort_request(["a0", "a3", "unknown"])  # a0 runs, a3 waits
    outs = {o.request_id: o for o in engine.step()}
    assert outs["a0"].finished and outs["a0"].outputs[0].finish_reason == "abort"
    assert len(outs["a0"].outputs[0].token_ids) == 2
    assert outs["a3"].outputs[0].finish_reason == "abort" and outs["a3"].outputs[0].token_ids == []
    done = {o.request_id for _ in range(60) for o in engine.step() if o.finished}
    assert done == {"a1", "a2"}
    assert_all_blocks_free(engine)


def test_abort_of_a_finished_request_never_hits_a_new_one_with_its_id(llama_dir):
    """An abort that arrives while its request finishes inside the same step must not abort a
    request added afterwards under the same id."""
    path, _ = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=64)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request("x", [5, 6, 7], one)
    take_intake = engine._take_intake

    def intake_then_abort():  # the abort lands after this step's intake, as from another thread
        outputs = take_intake()
        engine.abort_request("x")
        return outputs

    engine._take_intake = intake_then_abort
    first = {o.request_id: o for o in engine.step()}
    engine._take_intake = take_intake
    assert first["x"].finished and first["x"].outputs[0].finish_reason == "length"
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = [o for _ in range(10) for o in engine.step() if o.finished]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"]
    assert len(outs[0].outputs[0].token_ids) == 3
    assert_all_blocks_free(engine)


def test_rows_of_finished_requests_are_freed_even_when_the_step_fails_after_scheduling(llama_dir):
    """A SchedulerOutput hands the ids that left over once: a step that fails after schedule()
    (here: making its adapters resident) must still free their rows, or the id is stuck in a row.
    The failure fails that step's requests (y) only; the engine serves the next ones."""
    path, _ = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=2, max_model_len=64)
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    engine.add_request("y", [8, 9], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o.request_id for o in engine.step() if o.finished] == ["x"]
    activate = engine.adapters.activate

    def failing_activate(scheduled):
        raise RuntimeError("slot write failed")

    engine.adapters.activate = failing_activate
    failed = {o.request_id: o.outputs[0].finish_reason for o in engine.step() if o.finished}
    engine.adapters.activate = activate
    assert failed == {"y": "error"}
    assert engine.runner.input_batch.row_of("x") is None
    assert engine.runner.input_batch.row_of("y") is None
    engine.add_request("x", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = {o.request_id: o for _ in range(10) for o in engine.step() if o.finished}
    assert {i: len(o.outputs[0].token_ids) for i, o in outs.items()} == {"x": 3}
    assert_all_blocks_free(engine)


def test_requests_added_from_another_thread_while_stepping(llama_dir, greedy_oracle):
    path, hf = llama_dir
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=64)
    prompts = make_prompts(8, seed=7)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    added = threading.Event()

    def producer():
        for i, prompt in enumerate(prompts):
            engine.add_request(f"t{i}", prompt, params)
        added.set()

    thread = threading.Thread(target=producer)
    thread.start()
    done = {}
    while not added.is_set() or engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    thread.join()
    assert done == {f"t{i}": greedy_oracle(hf, p, 4)[0] for i, p in enumerate(prompts)}
    assert_all_blocks_free(engine)


def test_engine_from_config_and_derived_limits(llama_dir):
    from lora_runner import EngineConfig

    path, _ = llama_dir
    config = EngineConfig(path, device="cpu", max_num_seqs=2)
    with pytest.raises(ValueError, match="not both"):
        LLMEngine(config, max_loras=2)
    engine = LLMEngine(config)
    assert engine.limits.max_model_len == 512  # on CPU, the model's max_position_embeddings
    assert engine.block_manager.num_blocks == 2 * 512 // 16  # default budget: max_num_seqs full requests
    assert engine.eos_token_ids == frozenset({2})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LLMEngine(path, device="cpu", max_model_len=1024)
