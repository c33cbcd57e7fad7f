"""Mixtral, Qwen3-MoE and Qwen2-MoE over tensor_parallel_size=2 (CPU, gloo): equal to tp=1.

Each family's tiny random checkpoint (tests/test_moe) is served by a tp=1 engine and by a tp=2
engine (the real multiprocess executor: one worker per rank holding its shard of every expert, of
the shared expert and of each adapter) over one mixed batch: the base model, per-expert LoRA on every
expert (+ q/v), per-expert LoRA on two experts only, router + shared-expert-gate LoRA, PEFT's
attention-only LoRA, a DoRA (attention, and Qwen2-MoE's shared expert) and PEFT's ``target_parameters``
LoRA on the fused experts, a soft prompt alone and beside the every-expert LoRA, over 2 slots (so the
ranks re-write slots on evictions), chunked prefill and preemption. Greedy tokens are equal and
logprobs agree within 1e-5 (fp32). Qwen3-MoE is also read from transformers 5's fused expert layout
(tp_shards' ranges of ``experts.gate_up_proj`` / ``down_proj``).

Without processes: each rank's shard of each MoE block (loaded from the checkpoint at rank r of 2,
its adapters' shards in its slots) is run with an all-reduce that records its operand; the block
reduces exactly once whatever LoRA runs (router, experts, shared expert: none added by LoRA), and
the two ranks' partial sums add up to the tp=1 block's output.
"""

from __future__ import annotations

import random

import pytest
import torch

from dataclasses import dataclass, field
from types import SimpleNamespace

import punica_kernels
from adapters import LoRARequest, LoRASlots, PromptAdapterRequest
from adapters.lora import load_lora
from adapters.sharding import shard_lora_weights, shard_spec
from engine_support import run_to_completion
from factories import save_lora, save_prompt_adapter
from lora_runner import LLMEngine, SamplingParams
from lora_runner.distributed import TensorParallel
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.checkpoint_base_weights import checkpoint_base_weights
from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.moe import SparseMoeBlock
from lora_runner.worker.kv_cache import kv_block_bytes
from test_moe import save_moe
from test_moe_lora import ADAPTERS, write_adapter

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters

ATOL = 1e-5
MAX_TOKENS = 6
KV_BLOCKS = 10  # blocks of 4 tokens: too few for 4 requests of ~20 tokens, so the scheduler preempts


def engine_kwargs(model_dir: str, **overrides) -> dict:
    """fp32 CPU; chunked prefill (16 tokens a step), preemption (KV_BLOCKS), 2 LoRA slots for 6 LoRAs."""
    kv = KV_BLOCKS * kv_block_bytes(ModelConfig.from_dir(model_dir), 4, torch.float32)
    return dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=40, block_size=4,
                max_num_batched_tokens=16, max_loras=2, max_lora_rank=8, max_cpu_loras=8, max_prompt_adapters=1,
                max_prompt_adapter_tokens=4, kv_cache_memory_bytes=kv, **overrides)


def write_adapters(root, hf, spec) -> dict[str, str]:
    """The batch's adapters by name -> directory (per-expert ones in PEFT's file format; PEFT writes the rest)."""
    dirs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        assert write_adapter(root / name, spec, targets, r, alpha, seed=30 + i), name
        dirs[name] = str(root / name)
    save_lora(hf, root / "attention-only", seed=31, r=4, target_modules=("q_proj", "o_proj"))
    # DoRA on attention and Qwen2-MoE's shared expert's down_proj (row-parallel: its column scale on the
    # partial sums the block reduces once); not on the experts (refused: they apply plain LoRA only)
    shared = ["shared_expert.down_proj"] if getattr(hf.config, "shared_expert_intermediate_size", None) else []
    save_lora(hf, root / "dora", seed=33, r=4, lora_alpha=8, scale=0.15, use_dora=True,
              target_modules=["q_proj", "o_proj", *shared])
    save_lora(hf, root / "fused", seed=32, r=3, lora_alpha=6, target_modules=["q_proj"],
              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    dirs.update({name: str(root / name) for name in ("attention-only", "dora", "fused")})
    return dirs


def mixed_requests(dirs: dict[str, str], soft: str) -> list[tuple]:
    """The base model and each adapter, on prompts of 5..30 tokens; the soft prompt alone and with the
    every-expert LoRA."""
    rng = random.Random(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    names = [None, *dirs, "all-experts", None, "all-experts"]
    soft_from = len(names) - 2
    return [(f"m{i}", [rng.randrange(3, 250) for _ in range(rng.randint(5, 30))], greedy,
             None if name is None else LoRARequest(name, dirs[name]),
             PromptAdapterRequest("soft", soft) if i >= soft_from else None) for i, name in enumerate(names)]


def serve(model_dir: str, dirs: dict[str, str], soft: str, tensor_parallel_size: int,
          **engine_options) -> tuple[dict, LLMEngine]:
    """{request id: (tokens, logprobs)} of the mixed batch on a fresh engine (closed; ``engine_options``
    added to engine_kwargs'), and the engine."""
    engine = LLMEngine(model_dir, **engine_kwargs(model_dir, tensor_parallel_size=tensor_parallel_size,
                                                  **engine_options))
    try:
        for name, path in dirs.items():  # loaded before the run: no background-load timing in the schedule
            engine.add_lora(LoRARequest(name, path))
        engine.add_prompt_adapter(PromptAdapterRequest("soft", soft))
        done = run_to_completion(engine, mixed_requests(dirs, soft), per_step=3)
    finally:
        engine.close()
    return {rid: (out.outputs[0].token_ids, out.outputs[0].logprobs) for rid, out in done.items()}, engine


@pytest.mark.slow
@pytest.mark.parametrize("family,fused", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False),
                                          ("qwen2_moe", False)],
                         ids=["qwen3_moe", "qwen3_moe-fused", "mixtral", "qwen2_moe"])
def test_tp2_equals_tp1_for_a_mixed_batch_of_expert_adapters(family, fused, tmp_path):
    hf = save_moe(tmp_path / "model", family, seed=41, fused=fused)
    model_dir = str(tmp_path / "model")
    dirs = write_adapters(tmp_path, hf, ModelConfig.from_dir(model_dir).spec())
    save_prompt_adapter(hf, tmp_path / "soft", num_virtual_tokens=4, seed=7)
    want, tp1 = serve(model_dir, dirs, str(tmp_path / "soft"), 1)
    got, tp2 = serve(model_dir, dirs, str(tmp_path / "soft"), 2)
    assert tp2.scheduler.num_preemptions == tp1.scheduler.num_preemptions > 0
    assert tp2.adapters.manager.stats.lora_evictions > 0  # 6 LoRAs over 2 slots: every rank re-wrote slots
    assert set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        got_tokens, got_logprobs = got[rid]
        assert got_tokens == tokens, rid
        for step, token in enumerate(tokens):
            assert abs(got_logprobs[step][token] - logprobs[step][token]) <= ATOL, (rid, step)


@dataclass(frozen=True)
class RecordingTP(TensorParallel):
    """A rank of a group that is not there: all_reduce records (a copy of) its operand, changes nothing."""

    reduced: list = field(default_factory=list, compare=False)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        self.reduced.append(tensor.clone())
        return tensor


def block_outputs(model_dir: str, dirs: dict[str, str], tp: TensorParallel, hidden: torch.Tensor,
                  token_slots: torch.Tensor) -> list[torch.Tensor]:
    """Each MoE block's output over ``hidden`` [T, H] at ``tp``'s share, the adapters' shards in slots
    0.. in ``dirs`` order (read whole, DoRA's scales from the checkpoint's W, then sharded), token i on
    slot token_slots[i] (-1: base)."""
    model, config, _ = load_model(model_dir, tp=tp)
    spec, base_weight = config.spec(), checkpoint_base_weights(model_dir, config, torch.float32)  # DoRA's W
    slots = LoRASlots(shard_spec(spec, tp.rank, tp.world_size), len(dirs), 8)
    for slot, (name, path) in enumerate(dirs.items()):
        weights = load_lora(name, path, spec, max_lora_rank=8, base_weight=base_weight)
        slots.write(slot, shard_lora_weights(weights, spec, tp.rank, tp.world_size))
    meta = punica_kernels.LoRAMeta(hidden.shape[0], len(dirs), "cpu")
    punica_kernels.load_table(meta, token_slots)
    ctx = SimpleNamespace(lora=LoRAContext(meta, slots))  # the block reads only the step's LoRA
    return [layer.mlp(hidden, ctx) for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_ranks_partial_sums_add_up_to_the_block_with_one_reduce(family, tmp_path):
    hf = save_moe(tmp_path / "model", family, seed=43, fused=family == "mixtral")
    model_dir = str(tmp_path / "model")
    dirs = write_adapters(tmp_path, hf, ModelConfig.from_dir(model_dir).spec())
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(14, hf.config.hidden_size, generator=gen)  # [T, H]
    token_slots = torch.tensor([-1, 0, 1, 2, 3, 4, 5, -1, 4, 5, 1, 2, 0, 3])  # [T]: every adapter and the base
    want = block_outputs(model_dir, dirs, TensorParallel(), hidden, token_slots)
    no_lora = block_outputs(model_dir, dirs, TensorParallel(), hidden, torch.full_like(token_slots, -1))
    moving = (token_slots == 0) | (token_slots == 2) | (token_slots == 5)  # every expert, the router, fused
    if family == "qwen2_moe":  # and the DoRA on the shared expert's down_proj
        moving |= token_slots == 4
    assert all((w - b)[moving].abs().amax(dim=-1).min() > 1e-3 for w, b in zip(want, no_lora))  # LoRA shows
    ranks = [RecordingTP(rank, 2) for rank in range(2)]
    partial = [block_outputs(model_dir, dirs, tp, hidden, token_slots) for tp in ranks]
    for tp, outputs in zip(ranks, partial):
        assert len(tp.reduced) == len(outputs)  # one all-reduce per block, LoRA or not
        assert all(out is not None and torch.equal(out, reduced) for out, reduced in zip(outputs, tp.reduced))
    for layer, expected in enumerate(want):
        torch.testing.assert_close(partial[0][layer] + partial[1][layer], expected, atol=ATOL, rtol=1e-6)  # fp32 sums in another order
