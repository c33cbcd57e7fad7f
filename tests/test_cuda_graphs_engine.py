"""LLMEngine with decode graphs against the same engine run eagerly: greedy tokens and logprobs of a
mixed-adapter workload (more adapters than slots, no-adapter requests, staggered arrivals so steps
mix prefill and decode). On CPU the graphs are emulated (RerunGraph) through the engine's own
runner hook; on CUDA (marked gpu) the engine captures real graphs at start-up."""

import random

import pytest
import torch

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner import EngineConfig, LLMEngine, SamplingParams
from lora_runner.executor.limits import step_sizes
from lora_runner.worker.cuda_graphs import RerunGraph
from engine_support import run_to_completion
from test_engine_lora import NAMES

ENGINE = dict(max_num_seqs=12, max_model_len=64, max_loras=3, max_lora_rank=16, max_cpu_loras=5, block_size=4,
              max_num_batched_tokens=48, dtype="float32")


def workload(adapters, num_requests=14, seed=0):
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=1)
    requests = []
    for i in range(num_requests):
        name = rng.choice(NAMES + [None, None])
        prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 20))]
        requests.append((f"q{i}", prompt, params, LoRARequest(name, adapters[name][0]) if name else None))
    return requests


def check_same(eager, graphed):
    assert eager.keys() == graphed.keys()
    for request_id, out in eager.items():
        want, got = out.outputs[0], graphed[request_id].outputs[0]
        assert got.finish_reason == "length" and got.token_ids == want.token_ids, request_id
        for step, token in enumerate(want.token_ids):
            assert abs(got.logprobs[step][token] - want.logprobs[step][token]) <= 1e-4, (request_id, step)


def test_emulated_graphs_in_the_engine_match_eager(engine_checkpoint):
    path, _, adapters = engine_checkpoint
    eager = LLMEngine(path, device="cpu", **ENGINE)
    assert eager.runner.decode_graphs is None  # CPU: never captured at start-up
    graphed = LLMEngine(path, device="cpu", **ENGINE)
    graphed.runner.capture_decode_graphs(graphed.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    graphs = graphed.runner.decode_graphs
    assert len(graphs) == len(graphs.plan.keys()) and graphed.list_loras() == []  # warmup adapter removed
    requests = workload(adapters)
    check_same(run_to_completion(eager, requests, per_step=3), run_to_completion(graphed, requests, per_step=3))
    assert graphs.num_replays >= 7  # the decode-only steps replayed; prefill/mixed steps ran eagerly


def test_emulated_graphs_with_soft_prompts_match_eager(engine_checkpoint, tmp_path):
    """Requests with soft prompts (alone or with a LoRA): their placeholders are prefilled eagerly,
    their decodes replay graphs that carry no prompt-adapter mapping."""
    from factories import save_prompt_adapter

    path, hf, adapters = engine_checkpoint
    soft = {}
    for name, n in (("pa3", 3), ("pa6", 6)):
        save_prompt_adapter(hf, tmp_path / name, num_virtual_tokens=n, seed=n)
        soft[name] = PromptAdapterRequest(name, str(tmp_path / name))
    kwargs = dict(ENGINE, max_prompt_adapters=2, max_prompt_adapter_tokens=8, max_num_batched_tokens=16)
    eager = LLMEngine(path, device="cpu", **kwargs)
    graphed = LLMEngine(path, device="cpu", **kwargs)
    graphed.runner.capture_decode_graphs(graphed.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    outputs = []
    for engine in (eager, graphed):
        for i, (lora, prompt_adapter) in enumerate([(None, "pa3"), ("r4", "pa6"), ("r16-mlp", None), (None, None),
                                                    ("r8-qv", "pa3"), (None, "pa6")]):
            prompt = [random.Random(i).randrange(3, 256) for _ in range(2 + 3 * i)]
            engine.add_request(f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                               logprobs=1),
                               lora_request=LoRARequest(lora, adapters[lora][0]) if lora else None,
                               prompt_adapter_request=soft.get(prompt_adapter))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        outputs.append(done)
    check_same(*outputs)
    assert graphed.runner.decode_graphs.num_replays >= 3


def test_gpu_memory_utilization_is_validated():
    assert EngineConfig(model="m").gpu_memory_utilization == 0.9
    for bad in (0, 0.0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            EngineConfig(model="m", gpu_memory_utilization=bad)


@pytest.mark.gpu
def test_cuda_engine_captures_at_startup_and_matches_eager(engine_checkpoint):
    path, _, adapters = engine_checkpoint
    eager = LLMEngine(path, device="cuda", enforce_eager=True, **ENGINE)
    assert eager.runner.decode_graphs is None
    graphed = LLMEngine(path, device="cuda", gpu_memory_utilization=0.5, **ENGINE)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and len(graphs) == len(graphs.plan.keys())
    assert graphed.list_loras() == [] and int(graphed.adapters.manager.lora_slots.slot_ranks.max()) == 0
    # KV cache sized by the memory profile: min(what max_num_seqs full-length requests need, the budget)
    assert graphed.limits.num_kv_blocks == 12 * 16
    requests = workload(adapters, seed=1)
    check_same(run_to_completion(eager, requests, per_step=3), run_to_completion(graphed, requests, per_step=3))
    assert graphs.num_replays >= 7
    torch.cuda.synchronize()


def test_memory_profile_steps_run_with_dummy_adapters(engine_checkpoint):
    """The CUDA start-up profile's steps, on CPU: they run on a throwaway runner with max_loras dummy
    adapters resident (every token on the LoRA path) and leave no adapter behind."""
    from lora_runner.worker.cuda_graphs import resident_dummy_loras
    from lora_runner.worker.memory_profile import MemoryProfile, profile_memory, profile_steps

    engine = LLMEngine(engine_checkpoint[0], device="cpu", **ENGINE)
    max_model_len, max_batched, max_blocks = step_sizes(engine.config, engine.model_config.max_position_embeddings)
    runner = engine.executor.make_runner(max_blocks)
    runner.kv_cache.zero_()  # the CPU cache is allocated uninitialized: only what the profile writes is checked
    tier = engine.adapters.manager.loras
    with resident_dummy_loras(tier, ENGINE["max_loras"], 16) as slots:
        assert sorted(slots) == [0, 1, 2] and engine.adapters.manager.lora_slots.slot_ranks.tolist() == [16] * 3
        steps = profile_steps(max_num_seqs=12, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                              block_size=4, lora_slots=slots)
        assert profile_memory(runner, steps) == MemoryProfile(0, 0, 0, 0, 0)  # CPU: nothing to measure
        assert runner.lora_meta.num_tokens == 12  # the last step (12 decodes) ran on the LoRA path
        assert torch.isfinite(runner.kv_cache[:, :, :max_blocks]).all()
    assert tier.list() == [] and engine.adapters.manager.lora_slots.slot_ranks.tolist() == [0] * 3
