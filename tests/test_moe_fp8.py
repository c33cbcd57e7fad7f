"""Online FP8 (``quantization="fp8"``) on Mixtral, Qwen3-MoE, Qwen2-MoE and OLMoE: the routed experts too.

The oracle is transformers with every weight the engine quantizes replaced by its dequantized FP8 value
(each expert's gate, up and down rows, attention, the dense layers' MLP and Qwen2-MoE's shared expert:
float8_e4m3fn with one float32 scale per output channel, lora_runner.model.quant.fp8); the router and
the shared expert's gate stay float. Over that oracle (PEFT adapters on it for LoRA): greedy tokens
equal and logprobs within 1e-4 (fp32, CPU), from per-expert and fused checkpoints, for the base model
and a mixed batch of per-expert, fused ``target_parameters``, router and attention-only adapters over
fewer slots than adapters. The experts' weights are FP8 in memory, one scale per (expert, row); 4-bit
MoE checkpoints are refused naming what is not supported. (Compressed-tensors FP8 MoE checkpoints:
tests/test_moe_ct_fp8.py; the fused Triton GEMM with FP8 weights: tests/test_kernels_moe_fp8.py.)
"""

from __future__ import annotations

import pytest
import torch

from engine_support import assert_churn_exact, churn_adapters
from factories import save_lora
from lora_runner import LLMEngine
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.moe import SparseMoeBlock
from lora_runner.model.moe_fp8 import StackedFp8Linear
from lora_runner.model.quant.fp8 import FP8_DTYPE, FP8_MAX
from quant_support import fp8_oracle, weight_bytes
from test_moe import assert_engine_greedy_equals, build_moe, save_moe
from test_moe_lora import family_adapters

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters

ATOL = 1e-4


def test_oracle_quantizes_the_experts():
    """Guards the oracle: it differs from the float model in every expert, and not in the router."""
    hf = build_moe("mixtral")
    twin = fp8_oracle(hf)
    theirs, ours = hf.model.layers[0].mlp, twin.model.layers[0].mlp
    assert torch.equal(theirs.gate.weight, ours.gate.weight)
    for name in ("gate_up_proj", "down_proj"):
        moved = (getattr(theirs.experts, name) - getattr(ours.experts, name)).abs().amax(dim=(1, 2))  # [E]
        assert (moved > 0).all(), name


@pytest.mark.parametrize("name,fused", [("mixtral", False), ("qwen3_moe", True), ("qwen2_moe", False),
                                        ("qwen2_moe", True)],
                         ids=["mixtral", "qwen3_moe-fused", "qwen2_moe", "qwen2_moe-fused"])
def test_engine_greedy_equals_fp8_oracle(name, fused, tmp_path, greedy_oracle):
    hf = save_moe(tmp_path / "model", name, seed=7, fused=fused)
    assert_engine_greedy_equals(str(tmp_path / "model"), fp8_oracle(hf), greedy_oracle, quantization="fp8")


def test_olmoe_engine_greedy_equals_fp8_oracle(tmp_path, greedy_oracle):
    from test_moe_olmoe import save_olmoe

    hf = save_olmoe(tmp_path / "model", "clip-raw-topk", seed=7, fused=True)
    assert_engine_greedy_equals(str(tmp_path / "model"), fp8_oracle(hf), greedy_oracle, quantization="fp8")


def test_experts_are_fp8_in_memory_with_a_scale_per_expert_and_row(tmp_path):
    """Each block's experts: views of one float8_e4m3fn buffer per projection ([E, 2I, H], [E, H, I]) with
    float32 scales [E, 2I], [E, H]; every (expert, row) reaches the FP8 maximum (a scale per tensor, or
    per expert, would leave most rows below it); the router and shared expert gate float, the shared
    expert FP8. The experts take at most 0.55x of their bfloat16 bytes."""
    hf = save_moe(tmp_path / "model", "qwen2_moe", seed=8)
    model, _, _ = load_model(str(tmp_path / "model"), dtype=torch.bfloat16, quantization="fp8")
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert blocks
    for block in blocks:
        assert not block.router.method.quantized and not block.shared_expert_gate.method.quantized
        assert block.shared_expert.down.weight.dtype == FP8_DTYPE
        for projection, rows in (("gate_up", 2 * hf.config.moe_intermediate_size), ("down", hf.config.hidden_size)):
            linears = [getattr(expert, projection) for expert in block.experts]
            assert all(isinstance(linear.method, StackedFp8Linear) for linear in linears)
            weight = torch.stack([linear.weight for linear in linears])  # [E, N, K]
            scale = torch.stack([linear.weight_scale for linear in linears])  # [E, N]
            assert weight.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (len(linears), rows)
            base = linears[0].weight.untyped_storage().data_ptr()  # one buffer: entries of the same storage
            assert all(linear.weight.untyped_storage().data_ptr() == base for linear in linears)
            assert torch.equal(weight.float().abs().amax(dim=2), torch.full(scale.shape, FP8_MAX))
    plain, _, _ = load_model(str(tmp_path / "model"), dtype=torch.bfloat16)
    assert expert_bytes(model) <= 0.55 * expert_bytes(plain), (expert_bytes(model), expert_bytes(plain))
    assert weight_bytes(model) < weight_bytes(plain) - 0.45 * expert_bytes(plain)  # no float copy kept elsewhere


def expert_bytes(model) -> int:
    """Bytes of the routed experts' weights (and FP8 scales) of every MoE block."""
    return sum(t.numel() * t.element_size() for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)
               for expert in layer.mlp.experts for linear in (expert.gate_up, expert.down)
               for t in (linear.weight, getattr(linear, "weight_scale", None)) if t is not None)


def test_mixed_expert_adapters_over_fewer_slots_match_their_oracles_on_fp8(tmp_path, greedy_oracle):
    """Per-expert (every expert, two experts), router, PEFT attention-only and PEFT target_parameters
    adapters, 5 over 2 slots (LRU paging) with the base model, each against its oracle over the FP8 model."""
    hf = save_moe(tmp_path / "model", "qwen3_moe", seed=9, fused=True)
    twin = fp8_oracle(hf)
    spec = ModelConfig.from_dir(str(tmp_path / "model")).spec()
    adapters = family_adapters(tmp_path, twin, spec, seed=4)
    adapters["fused"] = (str(tmp_path / "fused"), save_lora(
        twin, tmp_path / "fused", seed=5, r=3, lora_alpha=6, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    engine = LLMEngine(str(tmp_path / "model"), dtype="float32", quantization="fp8", max_num_seqs=4,
                       max_model_len=40, max_loras=2, max_lora_rank=8, max_cpu_loras=2, block_size=4,
                       max_num_batched_tokens=16)
    requests, done = churn_adapters(engine, adapters, max_prompt=12)
    assert_churn_exact(requests, done, lambda name: adapters[name][1] if name else twin, greedy_oracle, ATOL)


def test_checkpoint_base_weights_are_the_served_ones(tmp_path):
    """DoRA's base weights read from the checkpoint (tensor parallelism: no rank holds whole rows) are the
    served FP8 model's: dequantized for attention and the shared expert, float for the router and the
    shared expert's gate (a quantized copy there would give DoRA norms of weights the model does not use)."""
    from lora_runner.model.checkpoint_base_weights import checkpoint_base_weights

    save_moe(tmp_path / "model", "qwen2_moe", seed=10)
    model, config, _ = load_model(str(tmp_path / "model"), quantization="fp8")
    read = checkpoint_base_weights(str(tmp_path / "model"), config)
    block = model.layers[1].mlp
    served = {"router": block.router, "shared_expert_gate": block.shared_expert_gate,
              "shared_expert.down": block.shared_expert.down, "qkv": model.layers[1].self_attn.qkv}
    for name, linear in served.items():
        assert torch.equal(read(1, name), linear.base_weight()), name


@pytest.mark.slow
@pytest.mark.parametrize("family,fused", [("qwen3_moe", True), ("qwen2_moe", False)],
                         ids=["qwen3_moe-fused", "qwen2_moe"])
def test_fp8_tp2_equals_tp1_for_a_mixed_batch_of_expert_adapters(family, fused, tmp_path):
    """tests/test_moe_tp.py's mixed batch (per-expert, fused, router, attention-only and DoRA adapters, a
    soft prompt, evictions, preemption) on the FP8 model: each rank quantizes its shard of every expert
    (down's rows by their maximum over both ranks) as one rank does, so tp=2 equals tp=1."""
    from factories import save_prompt_adapter
    from test_moe_tp import serve, write_adapters

    hf = save_moe(tmp_path / "model", family, seed=43, fused=fused)
    model_dir = str(tmp_path / "model")
    dirs = write_adapters(tmp_path, hf, ModelConfig.from_dir(model_dir).spec())
    save_prompt_adapter(hf, tmp_path / "soft", num_virtual_tokens=4, seed=7)
    want, _ = serve(model_dir, dirs, str(tmp_path / "soft"), 1, quantization="fp8")
    got, tp2 = serve(model_dir, dirs, str(tmp_path / "soft"), 2, quantization="fp8")
    assert tp2.adapters.manager.stats.lora_evictions > 0 and set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for step, token in enumerate(tokens):
            assert abs(got[rid][1][step][token] - logprobs[step][token]) <= 1e-5, (rid, step)


W4A16_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False,
                                                 "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize("quantization_config,what", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}, "int4 from gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}, "int4 from awq"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*mlp.gate$"],
      "config_groups": {"group_0": W4A16_GROUP}}, "int4 from compressed-tensors"),
])
def test_other_quantized_moe_checkpoints_are_refused_naming_what(quantization_config, what):
    """4-bit experts are not implemented (compressed-tensors FP8 checkpoints are read: tests/test_moe_ct_fp8.py)."""
    raw = build_moe("qwen3_moe").config.to_dict() | {"architectures": ["Qwen3MoeForCausalLM"]}
    with pytest.raises(ValueError, match=rf"quantized mixture-of-experts checkpoints are not supported \({what} on "
                                         r"Qwen3MoeForCausalLM\).*compressed-tensors FP8.*quantization='fp8'"):
        ModelConfig.from_dict(raw | {"quantization_config": quantization_config})
    assert ModelConfig.from_dict(raw, quantization="fp8").quantization.source == "online"
