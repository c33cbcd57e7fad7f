"""Quantized bases, model side (issue 25): every unsupported quantization_config refused with the field
named before any weight is allocated, and the 4-bit loader path (per-slice tensors -> the format's
Int4Format.convert -> Int4Weight.concat) driven through a stub format, against a float64 oracle."""

import copy
import json
import re
import types

import pytest
import torch

from adapters import LoRARequest
from lora_runner import EngineConfig, SamplingParams
from lora_runner.model import ModelConfig, load_model
from lora_runner.model import loader
from lora_runner.model.quant.int4_layout import SYMMETRIC_ZERO, Int4Weight, pack_int4

from engine_support import assert_exact, greedy_decode, make_engine, run_to_completion
from factories import save_lora, save_tiny_model, tiny_config
from quant_support import weight_bytes

FP8_GROUP = {"targets": ["Linear"], "format": "float-quantized",
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                   "dynamic": True}}
CT_FP8 = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
          "ignore": ["lm_head"], "config_groups": {"group_0": FP8_GROUP}}


def _ct(**changes):
    config = copy.deepcopy(CT_FP8)
    for path, value in changes.items():
        *parents, leaf = path.split("__")
        node = config
        for key in parents:
            node = node[key]
        node[leaf] = value
    return config


REFUSED = {  # case -> (quantization_config, the field the message must name)
    "ct-bits-3": (_ct(config_groups__group_0__weights__num_bits=3), "weights.num_bits"),
    "gptq-bits-3": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    "awq-bits-8": ({"quant_method": "awq", "bits": 8, "group_size": 128}, "bits"),
    "unknown-method": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method"),
    "fp8-method": ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quant_method"),
    "asymmetric-fp8": (_ct(config_groups__group_0__weights__symmetric=False), "weights.symmetric"),
    "static-activations": (_ct(config_groups__group_0__input_activations__dynamic=False),
                           "input_activations.dynamic"),
    "block-strategy": (_ct(config_groups__group_0__weights__strategy="block"), "weights.strategy"),
    "fp8-group-size": (_ct(config_groups__group_0__weights__group_size=32), "weights.group_size"),
    "int8-weights": (_ct(config_groups__group_0__weights__type="int"), "weights.type"),
    "kv-cache-scheme": (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    "quantized-lm-head": (_ct(ignore=[]), "ignore"),
    "partly-ignored": (_ct(ignore=["lm_head", "model.layers.0.mlp.down_proj"]), "ignore"),
    "two-groups": (_ct(config_groups={"a": FP8_GROUP, "b": FP8_GROUP}), "config_groups"),
    "attention-only": (_ct(config_groups__group_0__targets=["re:.*self_attn.*"]), "targets"),
    "not-compressed": (_ct(quantization_status="frozen"), "quantization_status"),
    "unknown-field": (_ct(new_feature={"on": True}), "new_feature"),
    "gptq-lm-head": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
}


def _raw(qcfg=None, **overrides) -> dict:
    raw = tiny_config("llama", **overrides).to_dict()
    if qcfg is not None:
        raw["quantization_config"] = qcfg
    return raw


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_quantization_config_names_the_field(case):
    qcfg, field = REFUSED[case]
    with pytest.raises(ValueError, match=r"quantization_config\S*" + re.escape(field)):
        ModelConfig.from_dict(_raw(qcfg))


def test_refused_before_any_weight_is_allocated(tmp_path, monkeypatch):
    save_tiny_model(tmp_path, "llama", tokenizer=False)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["quantization_config"] = REFUSED["ct-bits-3"][0]
    (tmp_path / "config.json").write_text(json.dumps(raw))

    def allocate(*args, **kwargs):
        raise AssertionError("the model was built for a refused quantization_config")

    monkeypatch.setattr(loader, "model_class", allocate)
    with pytest.raises(ValueError, match="num_bits"):
        load_model(str(tmp_path))


def test_quantization_option_is_checked():
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model="m", quantization="int8")
    with pytest.raises(ValueError, match="already"):
        ModelConfig.from_dict(_raw(CT_FP8), quantization="fp8")
    assert ModelConfig.from_dict(_raw(), quantization="fp8").quantization.source == "online"
    assert ModelConfig.from_dict(_raw()).quantization is None


# ---------------------------------------------------------------- the 4-bit loader path, through a stub format

class StubFormat:
    """An Int4Format whose checkpoint tensors are already the Int4Weight layout (qweight, scales, optional
    g_idx): what qint4's gptq / awq / ct_int4 convert from their own layouts."""

    suffixes = ("qweight", "scales")
    optional_suffixes = ("g_idx",)

    def __init__(self, group_size: int):
        self.group_size = group_size

    def convert(self, tensors, in_features, out_features, dtype):
        weight = Int4Weight(tensors["qweight"], tensors["scales"].to(dtype), None, tensors.get("g_idx"),
                            self.group_size)
        weight.check()
        return weight


@pytest.fixture
def stub_gptq(monkeypatch):
    """lora_runner.model.quant.gptq replaced by a module whose parse_config gives a StubFormat."""
    def parse_config(qcfg):
        if qcfg.get("sym") is False:
            raise ValueError("quantization_config.sym = false is not implemented (symmetric only)")
        return StubFormat(qcfg["group_size"])

    module = types.SimpleNamespace(parse_config=parse_config)
    monkeypatch.setitem(__import__("sys").modules, "lora_runner.model.quant.gptq", module)
    return module


def _quantize_int4(weight: torch.Tensor, group_size: int, act_order: bool, gen) -> dict[str, torch.Tensor]:
    """Symmetric 4-bit tensors of W [N, K] in the stub's layout (optionally with a shuffled g_idx)."""
    n, k = weight.shape
    g_idx = (torch.randperm(k, generator=gen) // group_size).to(torch.int32) if act_order else None
    groups = g_idx.long() if act_order else torch.arange(k) // group_size  # [K]
    scales = torch.zeros(n, k // group_size)
    for g in range(k // group_size):
        scales[:, g] = weight[:, groups == g].abs().amax(1).clamp(min=1e-8) / 7
    q = (weight / scales[:, groups]).round().clamp(-8, 7) + SYMMETRIC_ZERO  # [N, K] in 0..15
    tensors = {"qweight": pack_int4(q.to(torch.int32)), "scales": scales}
    if g_idx is not None:
        tensors["g_idx"] = g_idx
    return tensors


def save_stub_gptq(path, seed: int = 0, group_size: int = 32, act_order=(), **overrides):
    """A tiny Llama saved with every decoder linear as stub 4-bit tensors; returns the float64 oracle
    (transformers holding the dequantized weights). act_order: projections given a g_idx."""
    from safetensors.torch import save_file

    hf = save_tiny_model(path, "llama", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    oracle = copy.deepcopy(hf).double()
    tensors = {}
    for name, param in hf.state_dict().items():
        proj = name.rsplit(".", 2)[-2]
        if not name.endswith("_proj.weight"):
            tensors[name] = param.contiguous()
            continue
        quantized = _quantize_int4(param, group_size, proj in act_order, gen)
        for suffix, tensor in quantized.items():
            tensors[name.removesuffix("weight") + suffix] = tensor.contiguous()
        weight = StubFormat(group_size).convert(quantized, param.shape[1], param.shape[0], torch.float64)
        oracle.get_parameter(name).data.copy_(weight.dequantize(torch.float64))
    (path / "model.safetensors").unlink()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "sym": True}
    (path / "config.json").write_text(json.dumps(raw))
    return hf, oracle.eval()


def test_int4_checkpoint_loads_through_its_format_and_serves_with_lora(tmp_path, stub_gptq):
    hf, oracle = save_stub_gptq(tmp_path / "model", act_order=("down_proj",))
    save_lora(hf, tmp_path / "lora", seed=7, scale=0.15)
    from peft import PeftModel

    oracle_lora = PeftModel.from_pretrained(copy.deepcopy(oracle), str(tmp_path / "lora")).double().eval()
    engine = make_engine(str(tmp_path / "model"))
    down = engine.model.layers[0].mlp.down
    assert down.qweight.dtype == torch.int32 and down.g_idx is not None and not hasattr(down, "weight")
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    requests = [("base", [5, 6, 7], params), ("lora", [8, 9, 10, 11], params, LoRARequest("l", str(tmp_path / "lora")))]
    done = run_to_completion(engine, requests)
    assert_exact(done["base"], oracle, [5, 6, 7], greedy_decode, 5, tolerance=1e-3)
    assert_exact(done["lora"], oracle_lora, [8, 9, 10, 11], greedy_decode, 5, tolerance=1e-3)


def test_int4_slices_with_different_act_order_cannot_be_packed(tmp_path, stub_gptq):
    save_stub_gptq(tmp_path, act_order=("q_proj",))  # k_proj, v_proj without g_idx
    with pytest.raises(ValueError, match=r"q_proj.*g_idx|g_idx"):
        load_model(str(tmp_path))


def test_int4_group_size_must_divide_every_input_width(stub_gptq):
    raw = _raw({"quant_method": "gptq", "bits": 4, "group_size": 48, "sym": True})  # K = 64 and 96
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="sym"):  # the format module's own refusal comes through
        ModelConfig.from_dict(_raw({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False}))


def test_int4_weights_take_at_most_030x_of_bf16(tmp_path, stub_gptq):
    sizes = dict(vocab_size=32, hidden_size=256, intermediate_size=512, num_hidden_layers=1, tokenizer=False)
    save_stub_gptq(tmp_path / "int4", group_size=128, **sizes)
    save_tiny_model(tmp_path / "plain", "llama", **sizes)
    quantized, _, _ = load_model(str(tmp_path / "int4"), dtype=torch.bfloat16)
    plain, _, _ = load_model(str(tmp_path / "plain"), dtype=torch.bfloat16)
    assert weight_bytes(quantized) <= 0.30 * weight_bytes(plain), (weight_bytes(quantized), weight_bytes(plain))


def test_dora_norms_come_from_the_dequantized_weight(tmp_path, stub_gptq):
    from lora_runner.model.layers import lora_base_weights

    _, oracle = save_stub_gptq(tmp_path)
    model, _, _ = load_model(str(tmp_path))
    base_weight = lora_base_weights(model)
    theirs = oracle.model.layers[1].self_attn
    want = torch.cat([theirs.q_proj.weight, theirs.k_proj.weight, theirs.v_proj.weight]).float()
    torch.testing.assert_close(base_weight(1, "qkv"), want, rtol=0, atol=1e-6)
    assert base_weight(1, "qkv") is base_weight(1, "qkv")  # the slices of one packed weight: dequantized once
