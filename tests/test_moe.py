"""Mixtral, Qwen3-MoE and Qwen2-MoE base models against transformers (fp32 CPU).

Tiny random checkpoints written by transformers' save_pretrained (the per-expert layout it writes)
and, from the same model's state dict, in transformers 5's fused layout (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]); our logits within 1e-5 of transformers' forward over
a prefill and decodes on a scattered paged cache; an LLMEngine's greedy tokens equal transformers';
the routing renormalisation, the router's top-k and the shared expert's gate matter (breaking one is
caught).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from factories import save_tiny_tokenizer
from lora_runner import LLMEngine, SamplingParams
from lora_runner.model import load_model
from lora_runner.model.lora_linear import collect_spec
from lora_runner.model.moe import SparseMoeBlock
from test_model_harness import PagedDriver, TinyCheckpoint, assert_close, hf_logits

ATOL = 1e-5
SIZES = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)
MOE_MODELS = {
    # layer 1 dense (mlp_only_layers), renormalised top-2 of 6, head_dim from the config
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=48,
                                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[1], head_dim=32)),
    "qwen3_moe-raw-topk": ("Qwen3MoeConfig", dict(num_hidden_layers=2, intermediate_size=96, moe_intermediate_size=40,
                                                  num_experts=5, num_experts_per_tok=3, norm_topk_prob=False)),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2)),
    # shared expert with its sigmoid gate, q/k/v biases, layer 0 dense
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=40,
                                         shared_expert_intermediate_size=56, num_experts=4, num_experts_per_tok=2,
                                         norm_topk_prob=False, mlp_only_layers=[0], qkv_bias=True)),
}


def build_moe(name: str, seed: int = 0):
    """A random transformers MoE causal LM (fp32, eval) of MOE_MODELS[name]."""
    import transformers

    config_class, sizes = MOE_MODELS[name]
    config = getattr(transformers, config_class)(**SIZES, **sizes)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers zeroes biases and sets norms to 1, where a dropped one would hide
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape) * 0.3)
    return model


def save_checkpoint(hf, path, fused: bool = False) -> None:
    """Save a transformers MoE model and a tiny tokenizer into path: save_pretrained's per-expert layout,
    or (fused) the in-memory state dict, which holds the experts fused as transformers 5 does."""
    hf.save_pretrained(str(path))
    if fused:
        (path / "model.safetensors").unlink()
        save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(path / "model.safetensors"))
    save_tiny_tokenizer(path, hf.config.vocab_size)


def save_moe(path, name: str, seed: int = 0, fused: bool = False):
    """Save a tiny MoE model of MOE_MODELS[name] (per-expert or fused layout); returns transformers' model."""
    hf = build_moe(name, seed)
    save_checkpoint(hf, path, fused)
    return hf


def load_checkpoint(save, tmp_path_factory, name: str, fused: bool) -> TinyCheckpoint:
    """save(path, name, seed=, fused=) into a fresh folder, loaded by us beside transformers' model
    (the module-scoped checkpoint fixtures of the MoE families)."""
    path = tmp_path_factory.mktemp(name)
    hf = save(path, name, seed=len(name), fused=fused)
    model, config, _ = load_model(str(path))
    return TinyCheckpoint(hf=hf, model=model, config=config, path=str(path))


def every_layout(names) -> dict:
    """A checkpoint fixture's params and ids: each of `names` saved per expert and fused."""
    return dict(params=[(name, fused) for name in sorted(names) for fused in (False, True)],
                ids=lambda p: f"{p[0]}-{'fused' if p[1] else 'per-expert'}")


def assert_one_expert_layout(path: str) -> None:
    """The saved weights hold the experts either fused or per expert, never both nor neither."""
    from safetensors import safe_open

    with safe_open(f"{path}/model.safetensors", "pt") as handle:
        keys = list(handle.keys())
    fused = any(k.endswith("experts.gate_up_proj") for k in keys)
    per_expert = any(".experts.0." in k for k in keys)
    assert fused != per_expert


@pytest.fixture(scope="module", **every_layout(MOE_MODELS))
def ckpt(request, tmp_path_factory):
    return load_checkpoint(save_moe, tmp_path_factory, *request.param)


def test_checkpoint_layout_is_the_one_asked_for(ckpt):
    """Guards the layout parametrization: save_pretrained writes per-expert tensors, the fused files not."""
    assert_one_expert_layout(ckpt.path)


def test_config_and_spec(ckpt):
    config = ckpt.config
    raw = json.loads(open(f"{ckpt.path}/config.json").read())
    sparse = [i for i, layer in enumerate(ckpt.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert list(config.moe_layers) == sparse == [i for i in range(config.num_layers)
                                                  if i not in (raw.get("mlp_only_layers") or [])]
    assert config.norm_topk_prob == (raw["model_type"] == "mixtral" or raw["norm_topk_prob"])
    spec = config.spec()
    assert collect_spec(ckpt.model, spec) == spec  # the config's layout is the one the layers declare
    down = spec.module(sparse[-1], f"experts.{config.num_experts - 1}.down")
    assert (down.in_features, down.slice_sizes) == (config.moe_intermediate_size, (config.hidden_size,))


def test_prefill_and_decodes_match_transformers(ckpt):
    gen = torch.Generator().manual_seed(1)
    full = {s: torch.randint(3, 256, (n,), generator=gen) for s, n in enumerate((11, 7, 9))}
    expected = {s: hf_logits(ckpt.hf, tokens) for s, tokens in full.items()}
    driver = PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=2)
    for start, end in ((0, 5), (5, 6), (6, 7)):  # a prefill chunk, then two decode steps of the three sequences
        chunks = [(s, full[s][start:end]) for s in full]
        for (s, _), got in zip(chunks, driver.step(chunks)):
            assert_close(got, expected[s][start:end], f"seq {s} tokens {start}..{end}", atol=ATOL)


def test_routing_details_matter(ckpt, monkeypatch):
    """Guards the comparison: renormalising where the config does not (or not where it does), or
    routing to one expert fewer, moves the logits far from transformers'."""
    tokens = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(ckpt.hf, tokens)
    blocks = [layer.mlp for layer in ckpt.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    breaks = [("renormalize", not blocks[0].renormalize), ("top_k", blocks[0].top_k - 1)]
    if blocks[0].shared_expert is not None:  # Qwen2-MoE: the shared expert's gate always open
        breaks.append(("shared_expert_gate", lambda x, lora: torch.full((x.shape[0], 1), 30.0)))
    for attribute, broken in breaks:
        for block in blocks:
            owner = block.shared_expert_gate if attribute == "shared_expert_gate" else block
            monkeypatch.setattr(owner, "forward" if attribute == "shared_expert_gate" else attribute, broken)
        (got,) = PagedDriver(ckpt.model, ckpt.config).step([(0, tokens)])
        assert (got - expected).abs().max() > 1e-2, attribute
        monkeypatch.undo()


@pytest.mark.parametrize("name", sorted(MOE_MODELS))
def test_engine_greedy_equals_transformers(name, tmp_path, greedy_oracle):
    hf = save_moe(tmp_path / "model", name, seed=5)
    assert_engine_greedy_equals(str(tmp_path / "model"), hf, greedy_oracle)


def assert_engine_greedy_equals(model_dir: str, hf, greedy_oracle, **engine_options) -> None:
    """Three prompts (chunked prefill at 16 tokens a step) through the engine (``engine_options`` added to
    its arguments): greedy tokens equal transformers' and logprobs within 1e-4."""
    engine = LLMEngine(model_dir, dtype="float32", max_num_seqs=3, max_model_len=40, block_size=4,
                       max_num_batched_tokens=16, **engine_options)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    gen = torch.Generator().manual_seed(6)
    prompts = {f"r{i}": torch.randint(3, 256, (n,), generator=gen).tolist() for i, n in enumerate((6, 13, 3))}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id, prompt in prompts.items():
        tokens, logprobs = greedy_oracle(hf, prompt, 5)
        completion = done[request_id].outputs[0]
        assert completion.token_ids == tokens, request_id
        for step, (got, want) in enumerate(zip(completion.logprobs, logprobs)):
            assert abs(got[tokens[step]] - want) <= 1e-4, (request_id, step)


def test_an_uneven_expert_split_is_refused():
    """(tp=2 == tp=1: tests/test_moe_tp.py; quantized MoE checkpoints refused: tests/test_moe_fp8.py)"""
    from lora_runner.model.config import ModelConfig

    raw = build_moe("mixtral").config.to_dict() | {"architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ValueError, match=r"moe_intermediate_size \(48\) is not divisible by tensor_parallel_size \(5\)"):
        ModelConfig.from_dict(raw).spec().module(0, "experts.3.down").check_split(5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_lora_delta_is_the_dense_kernels_over_the_routed_rows(dtype):
    """add_expert_lora over a subset of rows equals punica_kernels.add_lora (the dense linears' LoRA:
    scaling on the float32 intermediate, slot -1 rows untouched) over the same rows."""
    import punica_kernels
    from adapters.spec import LoRAModule, ModelSpec
    from adapters.slots import LoRASlots
    from lora_runner.model.forward_context import LoRAContext
    from lora_runner.model.lora_linear import LoRALinear
    from lora_runner.model.moe import add_expert_lora

    module = LoRAModule(0, "experts.0.gate_up", 24, (8, 16), (("e.gate", (0,)), ("e.up", (1,))), dora=False)
    slots = LoRASlots(ModelSpec(num_layers=1, hidden_size=24, modules=(module,)), 3, 4, dtype=dtype)
    gen = torch.Generator().manual_seed(7)
    for tensor in (*slots.weights(0, module.name), slots.scales(0, module.name)[0]):
        tensor.copy_(torch.randn(tensor.shape, generator=gen))
    token_slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])  # [M]
    x = torch.randn(7, 24, generator=gen).to(dtype)  # [M, K]
    y = torch.randn(7, 24, generator=gen).to(dtype)  # [M, N]
    meta = punica_kernels.LoRAMeta(16, 3, "cpu")
    punica_kernels.load_table(meta, token_slots)
    expected = punica_kernels.add_lora(y.clone(), x, *slots.weights(0, module.name), meta, module.slice_sizes,
                                       slice_scales=slots.scales(0, module.name)[0], backend="torch")
    linear = LoRALinear(module, False, dtype, "cpu")
    got = add_expert_lora(y.clone(), x, token_slots, LoRAContext(meta, slots), linear)
    assert torch.equal(got[token_slots < 0], y[token_slots < 0])
    torch.testing.assert_close(got, expected)  # the dtype's default tolerances
