"""OLMoE (``OlmoeForCausalLM``) against transformers, base and with expert LoRA (fp32 CPU).

OLMoE is Qwen3-MoE-like (top-k routing, renormalised only with ``norm_topk_prob``, the routing
weights in the model dtype, no shared expert) but its q and k RMSNorms span the whole projection
(every head together) and ``clip_qkv`` clamps q, k and v after them. Tiny random checkpoints
written by transformers (save_pretrained's per-expert layout, and the fused in-memory tensors);
logits within 1e-5 of transformers' over a prefill and decodes; an engine's greedy tokens equal
transformers'; a per-expert adapter against the merged-weights oracle and PEFT's target_parameters
adapter against PEFT's forward, in one batch with the base; per-head norms, no clamp or
renormalising where the config does not are caught.
"""

from __future__ import annotations

import pytest
import torch

from adapters.lora import load_lora
from adapters.slots import LoRASlots
from factories import save_lora
from lora_runner import LLMEngine
from lora_runner.distributed import TensorParallel
from lora_runner.model import load_model
from lora_runner.model.llama import Attention
from lora_runner.model.moe import SparseMoeBlock
from test_model_harness import PagedDriver, assert_close, hf_logits
from test_moe import (SIZES, assert_engine_greedy_equals, assert_one_expert_layout, every_layout, load_checkpoint,
                      save_checkpoint)
from test_moe_lora import assert_slots_match_oracles, merged_model, write_adapter

ATOL = 1e-5
VARIANTS = {  # clip_qkv low enough that q, k or v values are clamped
    "clip-raw-topk": dict(num_hidden_layers=2, intermediate_size=40, num_experts=6, num_experts_per_tok=2,
                          clip_qkv=0.6, norm_topk_prob=False),
    "renormalised": dict(num_hidden_layers=2, intermediate_size=48, num_experts=4, num_experts_per_tok=3,
                         norm_topk_prob=True),
}


def save_olmoe(path, variant: str, seed: int = 0, fused: bool = False):
    """A random transformers OLMoE (fp32, eval; norms randomized) saved in the per-expert or fused layout."""
    import transformers

    config = transformers.OlmoeConfig(**SIZES, **VARIANTS[variant])
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers sets norms to 1 and the router to 0, where a dropped one would hide
        for name, param in hf.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                param.add_(torch.randn(param.shape) * 0.3)
    save_checkpoint(hf, path, fused)
    return hf


@pytest.fixture(scope="module", **every_layout(VARIANTS))
def olmoe(request, tmp_path_factory):
    return load_checkpoint(save_olmoe, tmp_path_factory, *request.param)


def test_checkpoint_layout_is_the_one_asked_for(olmoe):
    """Guards the layout parametrization: save_pretrained writes per-expert tensors, the fused files not."""
    assert_one_expert_layout(olmoe.path)


def test_config_reads_olmoe(olmoe):
    hf, model, config = olmoe.hf, olmoe.model, olmoe.config
    assert (config.architecture, config.qk_norm, config.qk_norm_whole) == ("OlmoeForCausalLM", True, True)
    assert config.moe_layers == tuple(range(config.num_layers)) and config.shared_expert_intermediate_size is None
    assert (config.num_experts, config.moe_intermediate_size) == (hf.config.num_experts, hf.config.intermediate_size)
    assert config.norm_topk_prob == hf.config.norm_topk_prob and config.clip_qkv == hf.config.clip_qkv
    assert not config.router_weights_in_float
    attention = model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (config.num_heads * config.head_dim,)
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers)


def test_prefill_and_decodes_match_transformers(olmoe):
    hf, model, config = olmoe.hf, olmoe.model, olmoe.config
    gen = torch.Generator().manual_seed(1)
    full = {s: torch.randint(3, 256, (n,), generator=gen) for s, n in enumerate((11, 7, 9))}
    expected = {s: hf_logits(hf, tokens) for s, tokens in full.items()}
    driver = PagedDriver(model, config, block_size=4, seed=2)
    for start, end in ((0, 5), (5, 6), (6, 7)):
        chunks = [(s, full[s][start:end]) for s in full]
        for (s, _), got in zip(chunks, driver.step(chunks)):
            assert_close(got, expected[s][start:end], f"seq {s} tokens {start}..{end}", atol=ATOL)


def test_olmoe_details_matter(olmoe, monkeypatch):
    """Guards the comparison: per-head q/k norms, no clamp, or the other renormalisation move the logits."""
    hf, model, config = olmoe.hf, olmoe.model, olmoe.config
    tokens = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(hf, tokens)
    attentions = [layer.self_attn for layer in model.layers]
    blocks = [layer.mlp for layer in model.layers]

    def per_head_norms():  # the norm weights reused per head (Qwen3's way): its first head_dim entries
        for attention in attentions:
            monkeypatch.setattr(attention, "qk_norm_whole", False)
            for norm in (attention.q_norm, attention.k_norm):
                monkeypatch.setattr(norm, "weight", torch.nn.Parameter(norm.weight[:config.head_dim].clone()))

    breaks = {"per-head norms": per_head_norms,
              "renormalize": lambda: [monkeypatch.setattr(b, "renormalize", not b.renormalize) for b in blocks]}
    if config.clip_qkv is not None:
        breaks["no clamp"] = lambda: [monkeypatch.setattr(a, "clip_qkv", None) for a in attentions]
    for name, apply in breaks.items():
        apply()
        (got,) = PagedDriver(model, config).step([(0, tokens)])
        assert (got - expected).abs().max() > 1e-3, name
        monkeypatch.undo()


def test_engine_greedy_equals_transformers(tmp_path, greedy_oracle):
    hf = save_olmoe(tmp_path / "model", "clip-raw-topk", seed=5)
    assert_engine_greedy_equals(str(tmp_path / "model"), hf, greedy_oracle)


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters
def test_expert_lora_matches_merged_weights_and_peft(tmp_path):
    """One batch: the base, per-expert LoRA on every expert + q/v and the router (merged-weights oracle),
    PEFT's target_parameters LoRA on the fused experts (PEFT's forward)."""
    hf = save_olmoe(tmp_path / "model", "clip-raw-topk", seed=24)
    model, config, _ = load_model(str(tmp_path / "model"))
    spec = config.spec()
    factors = write_adapter(tmp_path / "per-expert", spec, ["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj",
                                                            "gate"], 4, 8, seed=2)
    assert any(".experts.3.down_proj" in path for path in factors) and any(p.endswith("mlp.gate") for p in factors)
    oracles = {"per-expert": merged_model(hf, factors, 2.0),
               "fused": save_lora(hf, tmp_path / "fused", seed=1, r=3, lora_alpha=6, target_modules=["k_proj"],
                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])}
    slots, slot_of = LoRASlots(spec, 2, 8), {"fused": 1, "per-expert": 0}
    slots.write(1, load_lora("fused", str(tmp_path / "fused"), spec, max_lora_rank=8))
    slots.write(0, load_lora("per-expert", str(tmp_path / "per-expert"), spec, max_lora_rank=8))
    assert_slots_match_oracles(model, config, hf, slots, slot_of, oracles, moved=("fused", "per-expert"), atol=1e-4)


def test_tensor_parallel_olmoe_is_refused_naming_the_norms(tmp_path, monkeypatch):
    """By the engine before any rank starts, and by a rank's attention layer."""
    from lora_runner.executor import multiproc

    save_olmoe(tmp_path / "model", "renormalised")
    _, config, _ = load_model(str(tmp_path / "model"))
    with pytest.raises(ValueError, match="q and k over every head together.*tensor_parallel_size=1"):
        Attention(config, 0, torch.float32, "cpu", TensorParallel(rank=0, world_size=2))
    monkeypatch.setattr(multiproc.MultiprocExecutor, "__init__", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(ValueError, match="q and k over every head together"):
        LLMEngine(str(tmp_path / "model"), dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=1 << 20)
