"""EngineConfig.batch_invariant: one fixed request's tokens and logprobs (sampled and prompt) are
bitwise equal alone and in 50 random batches (companions with random prompts, lengths, adapters of
ranks 4-16 or none, chunk sizes via max_num_batched_tokens, batch sizes via max_num_seqs, arrival
order); without the mode they differ on this CPU (so the comparison can fail); the mode stays
exact against PEFT and refuses where it cannot hold."""

from __future__ import annotations

import random

import pytest
import torch
from engine_support import assert_exact, assert_idle, make_engine, run_to_completion

from adapters import LoRARequest
from lora_runner import EngineConfig, SamplingParams
from punica_kernels import invariant

FIXED_ADAPTER = "r16-patterns"  # rank 16 with per-module ranks and alphas
# seeded sampling at temperature 1 (an RL sampler): the sampled tokens as well as the logprobs must repeat
FIXED_PARAMS = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
CHUNKS = (8, 16, 64)  # max_num_batched_tokens: the 21-token prompt in three, two or one step
BATCH_SIZES = (2, 4, 8)  # max_num_seqs
NUM_BATCHES = 50


@pytest.fixture(scope="module")
def fixed_prompt():
    gen = random.Random(0)
    return [gen.randrange(3, 256) for _ in range(21)]


def _engines(path: str, batch_invariant: bool, **overrides) -> dict:
    """One engine per (chunk, batch size), built on first use (prefix caching on: a later batch may
    also find the fixed prompt's blocks cached, one more way its computation can change)."""
    engines = {}

    def get(chunk: int, seqs: int):
        if (chunk, seqs) not in engines:
            engines[chunk, seqs] = make_engine(path, max_num_batched_tokens=chunk, max_num_seqs=seqs,
                                               max_loras=2, enable_prefix_caching=True,
                                               batch_invariant=batch_invariant, **overrides)
        return engines[chunk, seqs]
    return get


def _random_batch(gen: random.Random, adapters: dict) -> tuple[list[tuple], int, int, int | None]:
    """(companion requests, chunk, batch size, requests added per step) drawn from gen."""
    names = [None, *adapters]
    companions = []
    for i in range(gen.randrange(0, 6)):
        name = gen.choice(names)
        lora = None if name is None else LoRARequest(name, 1 + sorted(adapters).index(name), adapters[name][0])
        params = SamplingParams(temperature=gen.choice([0.0, 0.8]), seed=gen.randrange(1000),
                                max_tokens=gen.randrange(1, 7), logprobs=gen.choice([None, 2]), ignore_eos=True)
        companions.append((f"c{i}", [gen.randrange(3, 256) for _ in range(gen.randrange(1, 25))], params, lora))
    return companions, gen.choice(CHUNKS), gen.choice(BATCH_SIZES), gen.choice([None, 1, 2])


def _run_fixed(engine, prompt, lora, companions, per_step, gen: random.Random):
    """The fixed request's (tokens, logprobs, prompt logprobs) run among `companions` in a shuffled order."""
    requests = [("fixed", prompt, FIXED_PARAMS, lora), *companions]
    gen.shuffle(requests)
    done = run_to_completion(engine, requests, per_step=per_step)
    assert_idle(engine)
    output = done["fixed"]
    assert output.outputs[0].finish_reason == "length", output.outputs[0].error
    return output.outputs[0].token_ids, output.outputs[0].logprobs, output.prompt_logprobs


def _differing(engine_checkpoint, prompt, batch_invariant: bool, num_batches: int,
               fixed_adapter: str = FIXED_ADAPTER, **overrides) -> list[tuple]:
    """The batches (chunk, batch size, companions) whose fixed-request result is not the alone run's bits;
    engine_checkpoint: (model dir, _, {adapter name: (dir, _)})."""
    path, _, adapters = engine_checkpoint
    fixed_lora = LoRARequest(fixed_adapter, 1 + sorted(adapters).index(fixed_adapter), adapters[fixed_adapter][0])
    engines, gen = _engines(path, batch_invariant, **overrides), random.Random(1)
    alone = _run_fixed(engines(64, 8), prompt, fixed_lora, [], None, gen)
    differing = []
    for _ in range(num_batches):
        companions, chunk, seqs, per_step = _random_batch(gen, adapters)
        # floats compared with ==: equal bits (no NaN here), the dicts key for key
        if _run_fixed(engines(chunk, seqs), prompt, fixed_lora, companions, per_step, gen) != alone:
            differing.append((chunk, seqs, len(companions)))
    return differing


def test_fixed_request_is_bitwise_invariant_in_50_random_batches(engine_checkpoint, fixed_prompt):
    assert _differing(engine_checkpoint, fixed_prompt, batch_invariant=True, num_batches=NUM_BATCHES) == []


def test_moe_model_is_bitwise_invariant(tmp_path, fixed_prompt):
    """A mixture-of-experts model (Qwen3-MoE shaped) with LoRA on its router and experts: the expert
    groups change with the batch, each expert's GEMMs and LoRA run in fixed row blocks."""
    from test_moe import save_moe
    from test_moe_lora import family_adapters

    from lora_runner.model import load_model

    hf = save_moe(tmp_path / "model", "qwen3_moe", seed=22)
    adapters = family_adapters(tmp_path, hf, load_model(str(tmp_path / "model"))[1].spec(), seed=3)
    checkpoint = (str(tmp_path / "model"), hf, adapters)
    assert _differing(checkpoint, fixed_prompt, batch_invariant=True, num_batches=12, fixed_adapter="all-experts") == []


@pytest.mark.slow
def test_tensor_parallel_ranks_are_bitwise_invariant(engine_checkpoint, fixed_prompt):
    """At tensor_parallel_size=2 (worker processes): each rank's GEMMs in row blocks, the all-reduce's
    sums element by element in rank order."""
    assert _differing(engine_checkpoint, fixed_prompt, batch_invariant=True, num_batches=4,
                      tensor_parallel_size=2) == []


def test_without_the_mode_the_same_batches_differ(engine_checkpoint, fixed_prompt):
    """The comparison above can fail: on this CPU the default paths (the torch LoRA path's padded and
    run-grouped matmuls, the padded attention) change the fixed request's last bits."""
    assert _differing(engine_checkpoint, fixed_prompt, batch_invariant=False, num_batches=10) != []


def test_mode_is_exact_against_peft(engine_checkpoint, greedy_oracle, fixed_prompt):
    """The mode computes the same model: greedy tokens and logprobs of PEFT's, beside companions."""
    path, _, adapters = engine_checkpoint
    engine = make_engine(path, max_num_batched_tokens=8, batch_invariant=True)
    requests = [(name or "base", fixed_prompt[:12 + i], SamplingParams(temperature=0.0, max_tokens=5, logprobs=1),
                 None if name is None else LoRARequest(name, 1 + i, adapters[name][0]))
                for i, name in enumerate([None, "r4", "r8-rslora", "r16-mlp"])]
    done = run_to_completion(engine, requests)
    for request_id, prompt, _, lora in requests:
        model = engine_checkpoint[1] if lora is None else adapters[request_id][1]
        assert_exact(done[request_id], model, prompt, greedy_oracle)


def test_mode_is_off_by_default_and_per_thread(engine_checkpoint):
    path, _, _ = engine_checkpoint
    assert EngineConfig(model=path).batch_invariant is False
    assert not invariant.enabled()
    with invariant.active():
        assert invariant.enabled()
    assert not invariant.enabled()


@pytest.mark.parametrize("overrides, message", [(dict(quantization="fp8"), "unquantized")])
def test_mode_refuses_what_it_cannot_hold(engine_checkpoint, overrides, message):
    path, _, _ = engine_checkpoint
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=path, device="cpu", batch_invariant=True, **overrides)


def test_rows_matmul_row_results_do_not_depend_on_the_other_rows():
    """The GEMM blocks: a row alone and the same row among 1..40 random others (every position),
    through torch.mm and at a K wide enough that the default oneDNN/MKL calls block K by M."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 3072, generator=gen)
    row = torch.randn(1, 3072, generator=gen)
    alone = invariant.rows_matmul(row, lambda block: block @ weight.T)
    for num_rows in (2, 7, 8, 9, 40):
        for position in {0, num_rows // 2, num_rows - 1}:
            rows = torch.randn(num_rows, 3072, generator=gen)
            rows[position] = row[0]
            got = invariant.rows_matmul(rows, lambda block: block @ weight.T)
            assert torch.equal(got[position], alone[0]), (num_rows, position)


def test_lora_ops_in_the_mode_keep_their_semantics():
    """The mode's LoRA path (add_lora, and lora_shrink + lora_expand) against the default torch path in
    float64 (the oracle dtype), with slice scales, DoRA column scales and a bias, slots in any order
    and tokens without an adapter left bit-identical."""
    from punica_kernels import LoRAMeta, add_lora, load_table, lora_expand, lora_shrink

    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0, 1, 2])  # [T]
    sizes, rank, in_features = (5, 3, 3), 4, 7
    meta = LoRAMeta(16, 3, "cpu")
    load_table(meta, slots)
    x = torch.randn(9, in_features, generator=gen, dtype=torch.float64)
    lora_a = torch.randn(3, 3, rank, in_features, generator=gen, dtype=torch.float64)
    lora_b = torch.randn(3, sum(sizes), rank, generator=gen, dtype=torch.float64)
    scales = dict(slice_scales=torch.rand(3, 3, generator=gen, dtype=torch.float64),
                  column_scales=torch.rand(3, sum(sizes), generator=gen, dtype=torch.float64),
                  bias=torch.randn(sum(sizes), generator=gen, dtype=torch.float64))
    y = torch.randn(9, sum(sizes), generator=gen, dtype=torch.float64)
    want = add_lora(y.clone(), x, lora_a, lora_b, meta, sizes, backend="torch", **scales)
    with invariant.active():
        got = add_lora(y.clone(), x, lora_a, lora_b, meta, sizes, backend="torch", **scales)
        inter = lora_shrink(x, lora_a, meta, torch.full((9, 3, rank), float("nan"), dtype=torch.float64))
        split = lora_expand(y.clone(), inter, lora_b, meta, sizes, backend="torch", **scales)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(split, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[slots == -1], y[slots == -1])


def test_mode_refuses_a_checkpoint_quantized_in_its_config():
    """EngineConfig cannot see a GPTQ/AWQ checkpoint's config.json: the runner's factory refuses it."""
    from types import SimpleNamespace

    from lora_runner.executor.runner_factory import make_runner

    with pytest.raises(ValueError, match="unquantized"):
        make_runner(SimpleNamespace(batch_invariant=True), None, SimpleNamespace(quantization=object()),
                    lora_slots=None, device=torch.device("cpu"))
