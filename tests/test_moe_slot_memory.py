"""LoRA slot memory of mixture-of-experts models: bytes per slot, and the KV budget that leaves room for them.

A LoRA slot holds every LoRA-capable module at max_lora_rank, so on a mixture of experts it holds
every expert's A and B: adapters.slot_memory says how many bytes (exactly what build_slots
allocates, per rank), the start-up log reports it, and the KV cache is sized around the slots
(lora_runner.executor.startup: worker ranks on CPU have them taken off the host RAM before they
start; a device is checked before they are allocated).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from adapters.manager import build_slots
from adapters.slot_memory import all_ranks_slot_bytes, lora_slot_bytes
from lora_runner import EngineConfig
from lora_runner.executor import startup
from lora_runner.model import ModelConfig
from test_moe import build_moe

QWEN3_30B_A3B = dict(  # config.json of Qwen/Qwen3-30B-A3B (the sizes that matter here)
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144, moe_intermediate_size=768,
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
    tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)


def tiny_configs(family: str = "qwen3_moe") -> tuple[ModelConfig, ModelConfig]:
    """(a tiny MoE ModelConfig, the same decoder with a dense MLP in every layer: the same attention)."""
    raw = build_moe(family).config.to_dict()
    architecture = raw["architectures"][0] if raw.get("architectures") else {
        "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    moe = ModelConfig.from_dict(raw | {"architectures": [architecture]})
    dense = ModelConfig.from_dict(raw | {"architectures": [architecture.replace("Moe", "")],
                                         "model_type": family.removesuffix("_moe")})
    return moe, dense


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_bytes_per_slot_are_what_build_slots_allocates(family):
    moe, dense = tiny_configs(family)
    for world_size in (1, 2):
        for rank in range(world_size):
            allocated = build_slots(moe.spec(), max_loras=3, max_lora_rank=8, max_prompt_adapters=0,
                                    max_prompt_adapter_tokens=0, device="cpu", dtype=torch.float16, rank=rank,
                                    world_size=world_size).lora_set.nbytes
            got = lora_slot_bytes(moe.spec(), 8, torch.float16, rank, world_size)
            assert 3 * got.per_slot == allocated, (rank, world_size)
            assert 0 < got.experts < got.per_slot
    assert all_ranks_slot_bytes(moe.spec(), 3, 8, torch.float16, 2) == 3 * sum(
        lora_slot_bytes(moe.spec(), 8, torch.float16, rank, 2).per_slot for rank in range(2))
    assert lora_slot_bytes(dense.spec(), 8, torch.float16).experts == 0


def test_qwen3_30b_a3b_slot_at_rank_16_in_bf16():
    """The issue's figure: ~1.55 GiB of expert factors, plus their float32 slice scales (no DoRA column
    scales: experts apply plain LoRA only), attention and vocabulary LoRA."""
    spec = ModelConfig.from_dict(QWEN3_30B_A3B).spec()
    one = lora_slot_bytes(spec, 16, torch.bfloat16)
    factors = 48 * 128 * (2 * 16 * 2048 + 2 * 768 * 16 + 16 * 768 + 2048 * 16) * 2  # A, B of gate_up and down
    slice_scales = 48 * 128 * (2 + 1) * 4
    assert factors / 2**30 == pytest.approx(1.55, abs=0.01)
    assert one.experts == factors + slice_scales
    assert one.experts < one.per_slot < 1.6 * 2**30
    assert one.experts / one.per_slot > 0.95
    assert "1.59 GiB per LoRA slot (98% experts' LoRA), max_loras=4: 6.34 GiB" == one.describe(4)
    # what DoRA column scales on every expert would add: 84 MiB a slot (one float32 per output row)
    with_dora = replace(spec, modules=tuple(replace(m, dora=True) for m in spec.modules))
    column_scales = 48 * 128 * (2 * 768 + 2048) * 4
    assert column_scales == 84 * 2**20
    assert lora_slot_bytes(with_dora, 16, torch.bfloat16).per_slot == one.per_slot + column_scales
    shards = [lora_slot_bytes(spec, 16, torch.bfloat16, rank, 2).per_slot for rank in range(2)]
    assert shards[0] == shards[1] < one.per_slot  # B of gate_up and A of down are split, the rest is not


def _engine_config(max_loras: int, **overrides) -> EngineConfig:
    return EngineConfig(model="m", device="cpu", dtype="float32", tensor_parallel_size=2, max_loras=max_loras,
                        max_lora_rank=16, max_cpu_loras=16, max_num_seqs=256, max_model_len=64, block_size=4,
                        **overrides)


def test_worker_ranks_kv_budget_leaves_room_for_every_ranks_expert_slots(monkeypatch):
    """Worker ranks on CPU: their slots are taken off the host RAM before the KV cache is sized, so a
    model whose slots hold experts reserves more (fewer KV blocks) than the same attention without."""
    monkeypatch.setattr(startup, "available_host_memory", lambda: 48 << 20)  # the CPU bound decides the KV cache
    moe, dense = tiny_configs()
    assert moe.num_kv_heads == dense.num_kv_heads and moe.num_layers == dense.num_layers  # same KV per token
    reserved = {name: startup.lora_slot_memory(_engine_config(8), config) for name, config in
                (("moe", moe), ("dense", dense))}
    assert reserved["moe"] == all_ranks_slot_bytes(moe.spec(), 8, 16, torch.float32, 2) > reserved["dense"] > 0
    blocks = {name: startup.worker_limits(_engine_config(8), config).num_kv_blocks for name, config in
              (("moe", moe), ("dense", dense))}
    assert blocks["moe"] < blocks["dense"]
    assert startup.worker_limits(_engine_config(1), moe).num_kv_blocks > blocks["moe"]


def test_slots_larger_than_the_free_device_memory_are_refused_naming_their_size():
    moe, _ = tiny_configs()
    needed = startup.lora_slot_memory(_engine_config(8), moe)
    assert startup.lora_slot_memory(_engine_config(8), moe, free_bytes=needed) == needed
    with pytest.raises(ValueError, match=r"max_loras=8 LoRA slots at max_lora_rank=16 take .* per LoRA slot "
                                         r"\(\d+% experts' LoRA\).*lower max_loras or max_lora_rank"):
        startup.lora_slot_memory(_engine_config(8), moe, free_bytes=needed - 1)
