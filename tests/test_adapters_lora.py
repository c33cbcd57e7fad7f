"""PEFT LoRA parsing: deltas equal PEFT's on the same input; every refused or broken checkpoint raises."""

import logging
import shutil

import pytest
import torch

from adapters import (
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.lora import load_lora
from tests import factories

# name -> (arch, save_lora kwargs): ranks, patterns, rsLoRA, partial targets, regex targets, layers
VARIANTS = {
    "r8_all": ("llama", dict(r=8, lora_alpha=16)),
    "patterns": ("llama", dict(r=4, lora_alpha=8, rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
                               alpha_pattern={"v_proj": 3, "gate_proj": 32})),
    "rslora": ("llama", dict(r=16, lora_alpha=4, use_rslora=True)),
    "partial_layers": ("llama", dict(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=[1])),
    "regex": ("llama", dict(r=2, lora_alpha=5, target_modules=r".*\.(k_proj|up_proj)")),
    "all_linear": ("llama", dict(r=2, target_modules="all-linear")),  # PEFT saves full module paths
    "mistral": ("mistral", dict(r=4, target_modules=["o_proj", "down_proj", "gate_proj"])),
    "qwen2": ("qwen2", dict(r=8, lora_alpha=8, exclude_modules=["layers.0.self_attn.k_proj"])),
}


@pytest.fixture(scope="module")
def bases():
    return {arch: factories.build_tiny_model(arch, seed=1) for arch in ("llama", "mistral", "qwen2")}


@pytest.fixture
def base(bases):
    return bases["llama"]


def _our_delta(weights, x, lora_module, index):
    slices = weights.modules.get(lora_module.key)
    if slices is None or slices[index] is None:
        return None
    pair = slices[index]
    assert pair.column_scale is None  # plain LoRA
    return (x.double() @ pair.a.double().T) @ pair.b.double().T * pair.scaling  # [T, N_j]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_parsed_deltas_equal_peft(bases, tmp_path, variant):
    arch, kwargs = VARIANTS[variant]
    base = bases[arch]
    spec = factories.model_spec(base)
    peft_model = factories.save_lora(base, tmp_path, seed=sorted(VARIANTS).index(variant), **kwargs)
    weights = load_lora(variant, str(tmp_path), spec, max_lora_rank=16)
    num_targeted = 0
    assert len(spec.peft_targets()) == 7 * spec.num_layers  # q, k, v, o, gate, up, down of each layer
    for path, (lora_module, (index,)) in spec.peft_targets().items():
        module = peft_model.base_model.model.get_submodule(path)
        x = torch.randn(5, lora_module.in_features)
        ours = _our_delta(weights, x, lora_module, index)
        if not hasattr(module, "base_layer"):  # PEFT did not target it
            assert ours is None, path
            continue
        num_targeted += 1
        with torch.no_grad():
            expected = (module(x) - module.base_layer(x)).double()  # [T, N_j]
        assert ours is not None, path
        torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-5)
    assert num_targeted > 0
    assert weights.rank == max([kwargs["r"], *kwargs.get("rank_pattern", {}).values()])


def test_default_adapter_segment_and_bf16(base, tmp_path):
    spec = factories.model_spec(base)
    factories.save_lora(base, tmp_path, r=4)
    plain = load_lora("a", str(tmp_path), spec, max_lora_rank=4)
    factories.edit_adapter_tensors(
        tmp_path, lambda tensors: {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()})
    with_default = load_lora("a", str(tmp_path), spec, max_lora_rank=4)
    half = load_lora("a", str(tmp_path), spec, max_lora_rank=4, dtype=torch.bfloat16)
    assert plain.modules.keys() == with_default.modules.keys() == half.modules.keys()
    for key, slices in plain.modules.items():
        for p, q, h in zip(slices, with_default.modules[key], half.modules[key]):
            assert torch.equal(p.a, q.a) and torch.equal(p.b, q.b)
            assert h.b.dtype == torch.bfloat16
            torch.testing.assert_close(h.b.float(), p.b, rtol=1e-2, atol=1e-2)


def test_pickle_bin_needs_opt_in_and_matches_safetensors(base, tmp_path):
    spec = factories.model_spec(base)
    peft_model = factories.save_lora(base, tmp_path / "st", r=4)
    peft_model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert not (tmp_path / "bin" / "adapter_model.safetensors").exists()
    with pytest.raises(UnsafeAdapterError, match="allow_pickle"):
        load_lora("b", str(tmp_path / "bin"), spec, max_lora_rank=4)
    from_bin = load_lora("b", str(tmp_path / "bin"), spec, max_lora_rank=4, allow_pickle=True)
    from_st = load_lora("b", str(tmp_path / "st"), spec, max_lora_rank=4)
    for key, slices in from_st.modules.items():
        for p, q in zip(slices, from_bin.modules[key]):
            assert torch.equal(p.a, q.a) and torch.equal(p.b, q.b)


def test_malicious_pickle_never_runs(base, tmp_path):
    spec = factories.model_spec(base)
    factories.save_lora(base, tmp_path, r=4)
    (tmp_path / "adapter_model.safetensors").unlink()
    marker = tmp_path / "pwned"
    factories.write_malicious_pickle(tmp_path, marker)
    with pytest.raises(UnsafeAdapterError, match="refused to unpickle"):
        load_lora("evil", str(tmp_path), spec, max_lora_rank=4, allow_pickle=True)
    assert not marker.exists()


# (save_lora kwargs, config edits, expected error fragment): real PEFT checkpoints where PEFT can write them
# (LoRA on embed_tokens / lm_head is served; its refusals are in test_vocab_lora.py)
UNSUPPORTED = {
    "modules_to_save": (dict(modules_to_save=["lm_head"]), {}, "modules_to_save"),
    "bias": (dict(bias="lora_only"), {}, "bias"),
    "lora_bias": (dict(lora_bias=True), {}, "lora_bias"),
    "layer_replication": ({}, dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
    "alora": ({}, dict(alora_invocation_tokens=[5, 6]), "alora_invocation_tokens"),
    "pissa": ({}, dict(init_lora_weights="pissa_niter_4"), "init_lora_weights"),
    "ia3": ({}, dict(peft_type="IA3"), "peft_type"),
    "target_parameters": ({}, dict(target_parameters=["mlp.experts.down_proj"]), "target_parameters"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings while writing these checkpoints
@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_features_are_refused_by_name(base, tmp_path, case):
    kwargs, edits, field = UNSUPPORTED[case]
    factories.save_lora(base, tmp_path, r=4, **kwargs)
    if edits:
        factories.edit_adapter_config(tmp_path, **edits)
    with pytest.raises(UnsupportedAdapterError) as info:
        load_lora(f"tenant-{case}", str(tmp_path), factories.model_spec(base), max_lora_rank=8)
    message = str(info.value)
    assert f"tenant-{case}" in message and field in message and "supported" in message


def test_rank_over_limit_is_too_large(base, tmp_path):
    spec = factories.model_spec(base)
    factories.save_lora(base, tmp_path, r=4, rank_pattern={"down_proj": 16})
    with pytest.raises(AdapterTooLargeError, match="down_proj has rank 16, over max_lora_rank=8"):
        load_lora("big", str(tmp_path), spec, max_lora_rank=8)
    assert load_lora("big", str(tmp_path), spec, max_lora_rank=16).rank == 16


@pytest.mark.parametrize("overrides,fragment", [
    (dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2), "shape"),
    (dict(intermediate_size=48), "shape"),
    (dict(num_hidden_layers=3), "only 2 layers"),
])
def test_adapter_of_another_model_is_invalid(base, tmp_path, overrides, fragment):
    other = factories.build_tiny_model("llama", seed=2, **overrides)
    factories.save_lora(other, tmp_path, r=4)
    with pytest.raises(InvalidAdapterError, match=fragment):
        load_lora("other", str(tmp_path), factories.model_spec(base), max_lora_rank=8)


def _poison(value):
    def edit(tensors):
        key = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key][0, 0] = value
        return tensors
    return edit


@pytest.mark.parametrize("edit,dtype,fragment", [
    (_poison(float("nan")), torch.float32, "NaN or inf"),
    (_poison(float("inf")), torch.float32, "NaN or inf"),
    (_poison(1e5), torch.float16, "overflows"),
    (lambda t: {k: v for k, v in t.items() if "layers.1.self_attn.v_proj.lora_A" not in k}, torch.float32,
     "missing key"),
    (lambda t: {k: (v * 100).to(torch.int32) for k, v in t.items()}, torch.float32, "floating point"),
])
def test_broken_weights_are_invalid(base, tmp_path, edit, dtype, fragment):
    factories.save_lora(base, tmp_path, r=4, lora_alpha=8)
    factories.edit_adapter_tensors(tmp_path, edit)
    with pytest.raises(InvalidAdapterError, match=fragment):
        load_lora("broken", str(tmp_path), factories.model_spec(base), max_lora_rank=8, dtype=dtype)


def test_weights_of_untargeted_module_are_invalid(base, tmp_path):
    factories.save_lora(base, tmp_path, r=4, target_modules=["q_proj"])
    factories.edit_adapter_config(tmp_path, target_modules=["k_proj"])
    with pytest.raises(InvalidAdapterError, match="does not target"):
        load_lora("x", str(tmp_path), factories.model_spec(base), max_lora_rank=8)


def test_files_missing_corrupt_or_too_big(base, tmp_path):
    spec = factories.model_spec(base)
    factories.save_lora(base, tmp_path / "ok", r=4)
    size = (tmp_path / "ok" / "adapter_model.safetensors").stat().st_size
    with pytest.raises(AdapterTooLargeError, match="max_adapter_bytes"):
        load_lora("x", str(tmp_path / "ok"), spec, max_lora_rank=8, max_bytes=size - 1)
    assert load_lora("x", str(tmp_path / "ok"), spec, max_lora_rank=8, max_bytes=size).rank == 4

    shutil.copytree(tmp_path / "ok", tmp_path / "corrupt")
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"\x00" * (size + 10))
    with pytest.raises(AdapterTooLargeError):  # size is checked before the file is read
        load_lora("x", str(tmp_path / "corrupt"), spec, max_lora_rank=8, max_bytes=size)
    with pytest.raises(InvalidAdapterError, match="corrupt"):
        load_lora("x", str(tmp_path / "corrupt"), spec, max_lora_rank=8)

    (tmp_path / "corrupt" / "adapter_config.json").write_text("{not json")
    with pytest.raises(InvalidAdapterError, match="cannot parse"):
        load_lora("x", str(tmp_path / "corrupt"), spec, max_lora_rank=8)
    (tmp_path / "corrupt" / "adapter_config.json").unlink()
    with pytest.raises(AdapterNotFoundError, match="adapter_config.json"):
        load_lora("x", str(tmp_path / "corrupt"), spec, max_lora_rank=8)
    (tmp_path / "ok" / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterNotFoundError, match="adapter_model.safetensors"):
        load_lora("x", str(tmp_path / "ok"), spec, max_lora_rank=8)


def test_other_base_model_is_only_a_warning(base, tmp_path, caplog):
    spec = factories.model_spec(base)
    factories.save_lora(base, tmp_path, r=4)
    factories.edit_adapter_config(tmp_path, base_model_name_or_path="org/another-base")
    served = type(spec)(**{**spec.__dict__, "model_name": "org/our-base"})
    with caplog.at_level(logging.WARNING, logger="adapters.lora"):
        weights = load_lora("w", str(tmp_path), served, max_lora_rank=8)
    assert weights.rank == 4
    assert any("org/another-base" in r.getMessage() and "org/our-base" in r.getMessage() for r in caplog.records)
