"""Qwen3, Gemma 2 and Phi-3 against transformers (base logits) and PEFT (mixed-adapter batches).

Tiny checkpoints with every norm weight and bias randomized (transformers initializes Gemma's norms
to 0 and the others to 1, where a dropped or misapplied norm would hide). Per family:

* base logits within 1e-4 of transformers for the scenarios of test_model_forward (prefill batch,
  decodes over scattered blocks, mixed prefill + decode with graph padding, chunked prefill), on
  the torch attention and, for Gemma 2 (soft-capping + alternating windows), the Triton kernels;
* every logit of a mixed batch (base + 3 adapters read by adapters.lora into LoRASlots) within
  1e-4 of PEFT's forward, and an LLMEngine with 2 LoRA slots serving 3 PEFT adapters and the base
  model in mixed batches:
  greedy tokens equal and logprobs within 1e-4 of PEFT's forward; Phi-3 adapters target the fused
  qkv_proj / gate_up_proj;
* Phi-3's LongRoPE crossing original_max_position_embeddings vs transformers with its KV cache,
  Gemma 2's soft prompts vs PEFT prompt tuning, the soft-capping kernels vs float64, refusals.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import test_model_forward
from adapters import InvalidAdapterError
from adapters.lora import load_lora
from factories import build_tiny_model, edit_adapter_tensors, save_lora, save_prompt_adapter, save_tiny_tokenizer
from engine_support import assert_churn_exact, churn_adapters
from lora_runner import LLMEngine
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.forward_context import PromptAdapterContext
from test_model_harness import PagedDriver, TinyCheckpoint, assert_close, hf_logits

HEAD_DIM = 32  # != hidden / heads = 16: head_dim must come from the config (Qwen3, Gemma 2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}
FAMILIES = {
    "qwen3-bias-window": dict(arch="qwen3", head_dim=HEAD_DIM, attention_bias=True, use_sliding_window=True,
                              sliding_window=6, max_window_layers=1),
    "gemma2": dict(arch="gemma2", head_dim=HEAD_DIM, query_pre_attn_scalar=24, sliding_window=5,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
    # original length 32 > every scenario's sequences: the short factors and LongRoPE's attention factor
    "phi3-window-longrope": dict(arch="phi3", sliding_window=7, max_position_embeddings=128,
                                 original_max_position_embeddings=32, rope_parameters=LONGROPE),
}
PHI3_MODULES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def randomize_norms_and_biases(hf_model, seed: int) -> None:
    """Random norm weights (around 1 and around 0) and biases, so a dropped one shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(torch.randn(param.shape, generator=gen) * 0.3)


def save_family_model(path, arch: str, seed: int = 0, **overrides):
    """A tiny transformers model of `arch` with randomized norms and biases, saved with a tokenizer."""
    hf = build_tiny_model(arch, seed, **overrides)
    randomize_norms_and_biases(hf, seed)
    hf.save_pretrained(str(path))
    save_tiny_tokenizer(path, hf.config.vocab_size)
    return hf.eval()


def family_checkpoint(path, arch: str, seed: int = 0, **overrides) -> TinyCheckpoint:
    hf = save_family_model(path, arch, seed, **overrides)
    model, config, _ = load_model(str(path))
    return TinyCheckpoint(hf=hf, model=model, config=config, path=str(path))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def ckpt(request, tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp(request.param), seed=len(request.param), **FAMILIES[request.param])


# test_model_forward's scenarios, run here on the families' checkpoints (the `ckpt` fixture above)
test_prefill_batch = test_model_forward.test_prefill_batch
test_decode_steps = test_model_forward.test_decode_steps
test_mixed_prefill_and_decode = test_model_forward.test_mixed_prefill_and_decode
test_chunked_prefill = test_model_forward.test_chunked_prefill


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp("gemma2"), seed=6, **FAMILIES["gemma2"])


def test_configs_carry_each_familys_options(ckpt):
    config = ckpt.config
    if config.architecture == "Qwen3ForCausalLM":
        assert config.qk_norm and config.head_dim == HEAD_DIM and config.sliding_windows == (None, 6)
    elif config.architecture == "Gemma2ForCausalLM":
        assert config.sliding_windows == (5, None)  # transformers' layer_types: even layers slide
        assert config.attn_scale == 24 ** -0.5 and config.tie_word_embeddings and config.sandwich_norms
        assert config.hidden_act == "gelu_pytorch_tanh" and config.norm_unit_offset
    else:
        assert config.fused_projections and config.sliding_windows == (7, 7)
        assert config.rope.rope_type == "longrope"


def test_config_spec_is_the_layout_the_models_layers_declare(ckpt):
    """ModelConfig.spec() (what a process without the model validates adapters against) equals the
    LoRA modules collected from the built model, PEFT names included (Phi-3: the fused ones)."""
    from lora_runner.model.lora_linear import collect_spec

    spec = ckpt.config.spec()
    assert collect_spec(ckpt.model, spec) == spec and len(spec.modules) == 4 * ckpt.config.num_layers
    fused = ckpt.config.fused_projections
    assert [path.rsplit(".", 1)[1] for path, _ in spec.module(1, "qkv").peft_modules] == (
        ["qkv_proj"] if fused else ["q_proj", "k_proj", "v_proj"])


@pytest.mark.parametrize("scenario", [test_model_forward.test_decode_steps, test_model_forward.test_chunked_prefill])
def test_gemma2_on_triton_attention(gemma2, scenario, monkeypatch):
    """Soft-capping and per-layer windows through the Triton kernels (interpreter), vs transformers."""
    from lora_runner.model import attention

    monkeypatch.setenv(attention.BACKEND_ENV, "triton")
    calls = []
    real = attention._triton_paged_attention
    monkeypatch.setattr(attention, "_triton_paged_attention", lambda *args: calls.append(args[-2:]) or real(*args))
    scenario(gemma2)
    assert {(w, cap) for w, cap in calls} == {(5, 2.0), (None, 2.0)}  # both layer kinds, capped


def test_gemma2_caps_matter(gemma2):
    """Guards the comparisons: without either soft-cap the logits are far from transformers'."""
    tokens = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(3))
    expected = hf_logits(gemma2.hf, tokens)
    model = gemma2.model
    for drop in ("attention", "final"):
        if drop == "attention":
            saved = [layer.self_attn.softcap for layer in model.layers]
            for layer in model.layers:
                layer.self_attn.softcap = None
        else:
            saved, model.config = model.config, dataclasses.replace(model.config, final_logit_softcap=None)
        try:
            (got,) = PagedDriver(model, gemma2.config).step([(0, tokens)])
        finally:
            if drop == "attention":
                for layer, cap in zip(model.layers, saved):
                    layer.self_attn.softcap = cap
            else:
                model.config = saved
        assert (got - expected).abs().max() > 1e-2, drop
    (got,) = PagedDriver(model, gemma2.config).step([(0, tokens)])
    assert_close(got, expected, "restored")


def test_gemma2_soft_prompt_rows_are_not_scaled(gemma2, tmp_path):
    """PEFT prompt tuning on Gemma 2: soft-prompt rows are used as they are, token rows scaled."""
    num_virtual = 3
    peft_model = save_prompt_adapter(gemma2.hf, tmp_path / "pa", num_virtual_tokens=num_virtual, seed=2, scale=0.5)
    soft = peft_model.prompt_encoder["default"].embedding.weight.detach()
    tokens = torch.randint(3, 256, (5,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected = peft_model(input_ids=tokens[None]).logits[0, -len(tokens):]
    driver = PagedDriver(gemma2.model, gemma2.config)
    input_ids, positions, ctx = driver.context([(0, torch.cat((torch.zeros(num_virtual, dtype=torch.long), tokens)))])
    num_tokens = num_virtual + len(tokens)
    slots, rows = torch.full((num_tokens,), -1), torch.full((num_tokens,), -1)
    slots[:num_virtual], rows[:num_virtual] = 0, torch.arange(num_virtual)
    ctx.prompt_adapter = PromptAdapterContext(soft[None], slots, rows)
    with torch.no_grad():
        logits = gemma2.model.compute_logits(gemma2.model(input_ids, positions, ctx))
    assert_close(logits[num_virtual:], expected, "prompted Gemma 2")


def test_phi3_longrope_long_factors_match_cached_generation(tmp_path):
    """Past original_max_position_embeddings LongRoPE switches to the long factors for the whole
    call, as transformers does chunk by chunk with its KV cache (earlier keys keep their rotation)."""
    from transformers import DynamicCache

    ckpt = family_checkpoint(tmp_path, "phi3", seed=4, max_position_embeddings=64, original_max_position_embeddings=16,
                             rope_parameters=LONGROPE)
    tokens = torch.randint(3, 256, (26,), generator=torch.Generator().manual_seed(8))
    driver = PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=9)
    cache, start = DynamicCache(config=ckpt.hf.config), 0
    for n in [12, 6] + [1] * 8:  # short factors, a chunk that crosses 16, then decodes on the long ones
        chunk = tokens[start:start + n]
        with torch.no_grad():
            expected = ckpt.hf(chunk[None], past_key_values=cache, use_cache=True).logits[0]
        (got,) = driver.step([(0, chunk)])
        assert_close(got, expected, f"longrope, tokens {start}..{start + n}")
        start += n
    # the long factors are in use: the cache-less full forward (long factors for every position) differs
    assert (got[-1] - hf_logits(ckpt.hf, tokens)[-1]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- soft-capping kernels vs float64

def capped_attention_float64(case, scale: float, window: int | None, cap: float) -> torch.Tensor:
    """[real tokens, H, D]: softmax(cap * tanh(scale * q.k / cap)) @ v, causal, within the window."""
    outs, row = [], 0
    for k, v, query_len in zip(case.full_k, case.full_v, case.query_lens):
        length, num_kv_heads = k.shape[:2]
        q = case.query[row:row + query_len].double()  # [q, H, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.tanh(torch.einsum("qhd,khd->hqk", q, k) * scale / cap) * cap  # [H, q, L]
        q_pos, k_pos = torch.arange(length - query_len, length)[:, None], torch.arange(length)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), v))
        row += query_len
    return torch.cat(outs)


SOFTCAP_CASES = {  # id: (head_dim, dtype, query_lens, seq_lens, window, decode split count or None for prefill)
    "decode-d64-fp32-split4-window": (64, torch.float32, [1, 1, 1], [1, 90, 700], 64, 4),
    "decode-d256-fp32-nosplit": (256, torch.float32, [1, 1], [33, 300], None, 1),  # Gemma 2's head width
    "prefill-d256-fp16": (256, torch.float16, [40, 2], [40, 90], 24, None),
    "prefill-d256-fp32-window": (256, torch.float32, [20, 1, 37], [20, 50, 120], 16, None),
    "prefill-d64-fp16": (64, torch.float16, [45, 3], [45, 140], None, None),
}


@pytest.mark.parametrize("name", sorted(SOFTCAP_CASES))
def test_softcap_kernels_match_float64_and_torch_path(name):
    """Triton decode/prefill kernels (interpreter) and the torch path with a cap that bites (scores of
    a few units, cap 2): both within the dtype's tolerance of float64; padding rows stay zero."""
    from test_paged_attention import NAN, TOLERANCE, make_case, seed_of

    from lora_runner.model import paged_attention as kernels
    from lora_runner.model.attention import paged_attention

    head_dim, dtype, query_lens, seq_lens, window, num_splits = SOFTCAP_CASES[name]
    padding = 0 if num_splits else 2
    case = make_case(seed_of(name), query_lens, seq_lens, 16, (8, 2), head_dim, dtype, padding)
    scale, cap, tol = 0.4, 2.0, TOLERANCE[dtype]
    out = torch.full_like(case.query, NAN)
    attn = case.attn
    if num_splits:
        kernels.decode_attention(case.query, case.kv_layer, attn.block_tables, attn.seq_lens, scale, window,
                                 num_splits=num_splits, out=out, softcap=cap)
    else:
        kernels.prefill_attention(case.query, case.kv_layer, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                  attn.max_query_len, scale, window, out=out, softcap=cap)
    expected = capped_attention_float64(case, scale, window, cap)
    n = case.num_real
    torch.testing.assert_close(out[:n].double(), expected, atol=tol, rtol=tol)
    assert (out[n:] == 0).all()
    torch_path = paged_attention(case.query.float(), case.kv_layer.float(), attn, scale, window, backend="torch",
                                 softcap=cap)
    torch.testing.assert_close(torch_path[:n].double(), expected, atol=tol, rtol=tol)
    uncapped = paged_attention(case.query.float(), case.kv_layer.float(), attn, scale, window, backend="torch")
    assert (uncapped[:n].double() - expected).abs().max() > 10 * tol  # the cap changes the result


def test_softcap_must_be_positive():
    from test_paged_attention import make_case

    from lora_runner.model.attention import paged_attention

    case = make_case(1, [1], [4], 16, (4, 2), 64, torch.float32)
    with pytest.raises(ValueError, match="softcap"):
        paged_attention(case.query, case.kv_layer, case.attn, 0.1, softcap=0.0)


# ----------------------------------------------------------------------------- adapters vs PEFT

LORA_ADAPTERS = {  # family -> {adapter name: save_lora kwargs}
    "qwen3": {"all-r8": dict(seed=1, r=8, lora_alpha=16),
              "qv-r4-rslora": dict(seed=2, r=4, lora_alpha=8, use_rslora=True, target_modules=("q_proj", "v_proj")),
              "mlp-r16": dict(seed=3, r=16, lora_alpha=16, target_modules=("gate_proj", "up_proj", "down_proj"))},
    "gemma2": {"all-r8": dict(seed=1, r=8, lora_alpha=16),
               "ko-r4": dict(seed=2, r=4, lora_alpha=16, target_modules=("k_proj", "o_proj")),
               "up-down-r16-pattern": dict(seed=3, r=16, lora_alpha=8, target_modules=("up_proj", "down_proj"),
                                           rank_pattern={"down_proj": 4})},
    "phi3": {"fused-all-r8": dict(seed=1, r=8, lora_alpha=16, target_modules=PHI3_MODULES),
             "qkv-r4-rslora": dict(seed=2, r=4, lora_alpha=8, use_rslora=True, target_modules=("qkv_proj",)),
             "gate-up-r16-pattern": dict(seed=3, r=16, lora_alpha=16, target_modules=("gate_up_proj", "o_proj"),
                                         alpha_pattern={"gate_up_proj": 64})},
}
LORA_MODELS = {"qwen3": FAMILIES["qwen3-bias-window"], "gemma2": FAMILIES["gemma2"],
                 "phi3": dict(arch="phi3", sliding_window=7)}


@pytest.mark.parametrize("family", sorted(LORA_ADAPTERS))
def test_mixed_adapter_batch_logits_match_peft_forward(family, tmp_path):
    """Every logit of a mixed batch (no adapter and three adapters in three slots, prefill then
    decodes) within 1e-4 of PEFT's forward; adapters read by adapters.lora, written by LoRASlots."""
    import punica_kernels
    from adapters.slots import LoRASlots
    from lora_runner.model.forward_context import LoRAContext

    ckpt = family_checkpoint(tmp_path / "model", seed=12, **LORA_MODELS[family])
    spec = ckpt.config.spec()
    slots, peft_models, slot_of = LoRASlots(spec, 4, 16), {}, {}
    for slot, (name, kwargs) in zip((2, 0, 3), LORA_ADAPTERS[family].items()):
        peft_models[name] = save_lora(ckpt.hf, tmp_path / name, **kwargs)
        slots.write(slot, load_lora(name, str(tmp_path / name), spec, max_lora_rank=16))
        slot_of[name] = slot
    seq_adapter = dict(enumerate([None, *peft_models]))
    gen = torch.Generator().manual_seed(0)
    full = {s: torch.randint(3, 256, (9,), generator=gen) for s in seq_adapter}
    expected = {s: hf_logits(peft_models[a] if a else ckpt.hf, full[s]) for s, a in seq_adapter.items()}
    meta, driver = punica_kernels.LoRAMeta(64, 4, "cpu"), PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=1)
    for start, end in ((0, 6), (6, 7), (7, 8), (8, 9)):
        chunks = [(s, full[s][start:end]) for s in seq_adapter]
        punica_kernels.load_table(meta, torch.tensor([slot_of.get(seq_adapter[s], -1) for s, t in chunks for _ in t]))
        for (s, _), got in zip(chunks, driver.step(chunks, lora=LoRAContext(meta, slots))):
            assert_close(got, expected[s][start:end], f"tokens {start}..{end}, {seq_adapter[s] or 'base'}")


# cuda: Triton attention (soft-capping for Gemma 2) and decode CUDA graphs; fp32 dots in tf32x3 there
DEVICES = [("cpu", 1e-4), pytest.param("cuda", 1e-3, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device, tolerance", DEVICES)
@pytest.mark.parametrize("family", sorted(LORA_ADAPTERS))
def test_engine_mixed_adapters_more_than_slots_match_peft(family, device, tolerance, tmp_path, greedy_oracle):
    hf = save_family_model(tmp_path / "model", seed=11, **LORA_MODELS[family])
    adapters = {name: (str(tmp_path / name), save_lora(hf, tmp_path / name, scale=0.15, **kwargs))
                for name, kwargs in LORA_ADAPTERS[family].items()}
    engine = LLMEngine(str(tmp_path / "model"), device=device, dtype="float32", max_num_seqs=4, max_model_len=48,
                       max_loras=2, max_lora_rank=16, max_cpu_loras=2, block_size=4, max_num_batched_tokens=16)
    requests, done = churn_adapters(engine, adapters, max_prompt=14)  # 3 adapters over 2 slots, and the base
    assert_churn_exact(requests, done, lambda name: adapters[name][1] if name else hf, greedy_oracle, tolerance)
    differs = sum(name is not None and done[request_id].outputs[0].token_ids != greedy_oracle(hf, prompt, 4)[0]
                  for request_id, (prompt, name) in requests.items())
    assert differs >= 2  # the adapters change the output: a dropped delta would show


def test_phi3_fused_adapter_maps_onto_the_packed_slices(tmp_path):
    """A fused qkv_proj LoRA becomes per-slice pairs sharing A, with B split by the q/k/v rows (and the
    scaling kept beside it, applied on the fp32 intermediate)."""
    from safetensors.torch import load_file

    hf = save_family_model(tmp_path / "model", "phi3", seed=5)
    save_lora(hf, tmp_path / "a", r=4, lora_alpha=8, target_modules=("qkv_proj", "gate_up_proj"))
    spec = ModelConfig.from_dir(tmp_path / "model").spec()
    weights = load_lora("a", str(tmp_path / "a"), spec, max_lora_rank=8)
    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.self_attn.qkv_proj"
    a, b = saved[f"{prefix}.lora_A.weight"], saved[f"{prefix}.lora_B.weight"]
    q, kv = spec.slice_sizes("qkv")[:2]
    assert b.shape[0] == q + 2 * kv
    for pair, rows in zip(weights.modules[1, "qkv"], (slice(0, q), slice(q, q + kv), slice(q + kv, None))):
        assert torch.equal(pair.a, a) and torch.equal(pair.b, b[rows]) and pair.scaling == 2.0  # alpha / r
    assert len(weights.modules[0, "gate_up"]) == 2 and (0, "o") not in weights.modules


def test_adapters_whose_layout_does_not_fit_are_refused(tmp_path):
    phi3 = save_family_model(tmp_path / "phi3", "phi3", seed=5)
    llama = save_family_model(tmp_path / "llama", "llama", seed=5)
    phi3_spec = ModelConfig.from_dir(tmp_path / "phi3").spec()
    llama_spec = ModelConfig.from_dir(tmp_path / "llama").spec()
    save_lora(phi3, tmp_path / "fused", r=4, target_modules=("qkv_proj",))
    key = "base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight"
    save_lora(phi3, tmp_path / "short-b", r=4, target_modules=("qkv_proj",))
    edit_adapter_tensors(tmp_path / "short-b", lambda t: {**t, key: t[key][:-16]})  # B lacks v's last rows
    save_lora(llama, tmp_path / "split", r=4, target_modules=("q_proj", "v_proj"))
    with pytest.raises(InvalidAdapterError, match="qkv_proj.lora_B has shape"):
        load_lora("short-b", str(tmp_path / "short-b"), phi3_spec, max_lora_rank=8)
    with pytest.raises(InvalidAdapterError, match="matches no module"):
        load_lora("split", str(tmp_path / "split"), phi3_spec, max_lora_rank=8)  # Phi-3 has no q_proj
    with pytest.raises(InvalidAdapterError, match="matches no module"):
        load_lora("fused", str(tmp_path / "fused"), llama_spec, max_lora_rank=8)  # Llama has no qkv_proj
    load_lora("fused", str(tmp_path / "fused"), phi3_spec, max_lora_rank=8)  # the same file fits Phi-3


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gemma2", hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(model_type="gemma2", use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(model_type="qwen3", hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(model_type="phi3", rope_parameters={"rope_type": "longrope", "partial_rotary_factor": 0.5}),
     "partial_rotary_factor"),
    (dict(model_type="gemma2", layer_types=["chunked_attention", "full_attention"], sliding_window=4),
     "layer_types"),
    (dict(model_type="gemma3"), "supported: .*Qwen3ForCausalLM, Gemma2ForCausalLM, Phi3ForCausalLM"),
])
def test_unsupported_family_options_are_refused(change, message):
    raw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, **change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)
