"""The 4-bit checkpoint formats (lora_runner.model.quant.gptq / awq / ct_int4) against oracles written
here from each format's documented layout: known random 4-bit values, scales and zero points are packed
by this file's own packers (GPTQ, AWQ) or by compressed-tensors' own pack_to_int32 (its decompression
is then the oracle), and the converted Int4Weight must dequantize to the same float64 weights.

write_int4_checkpoint writes a whole tiny GPTQ / AWQ checkpoint directory from a float model (for the
end-to-end test through LLM once the loader reads these formats).
"""

import json
import re

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
from safetensors.torch import load_file, save_file

from lora_runner.model.quant import awq, ct_int4, gptq
from lora_runner.model.quant.int4_layout import Int4Weight

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: nibble i holds row AWQ_PACK_ORDER[i] of 8


# ---- the test's own packers, written from the formats' documentation (int64 sums, wrapped to int32)

def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_qweight(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] 0..15 -> GPTQ qweight int32 [K/8, N]: word [j, n] nibble i = q[n, 8j + i]."""
    n, k = q.shape
    words = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(k // 8):
        for i in range(8):
            words[j] += q[:, 8 * j + i].long() << (4 * i)
    return _to_int32(words)


def _along_n(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """values [R, N] 0..15 -> int32 [R, N/8]: word [r, j] nibble i = values[r, 8j + order[i]]."""
    rows, n = values.shape
    words = torch.zeros(rows, n // 8, dtype=torch.int64)
    for j in range(n // 8):
        for i in range(8):
            words[:, j] += values[:, 8 * j + order[i]].long() << (4 * i)
    return _to_int32(words)


def _oracle(q, zeros, scales, groups):
    """W [N, K] float64 = (q - zero) * scale, zero/scale [N, K/G] indexed by each column's group."""
    z = zeros.double()[:, groups] if torch.is_tensor(zeros) else float(zeros)
    return (q.double() - z) * scales.double()[:, groups]


def _act_order_groups(k: int, group_size: int, generator) -> torch.Tensor:
    """GPTQ act-order: columns quantized in a permuted order, group i = permuted columns iG..(i+1)G."""
    perm = torch.randperm(k, generator=generator)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // group_size
    return g_idx


def _gptq_layer(n, k, group_size, act_order, checkpoint_format, generator):
    q = torch.randint(0, 16, (n, k), generator=generator)
    scales = (torch.rand(n, k // group_size, generator=generator) + 0.05).half()
    groups = _act_order_groups(k, group_size, generator) if act_order else torch.arange(k) // group_size
    stored_zero = 8 - (1 if checkpoint_format == "gptq" else 0)  # v1 stores zero - 1
    tensors = {"qweight": _gptq_qweight(q),
               "qzeros": _along_n(torch.full((k // group_size, n), stored_zero), tuple(range(8))),
               "scales": scales.t().contiguous(),
               "g_idx": groups.to(torch.int32)}  # AutoGPTQ writes g_idx with and without act-order
    return tensors, _oracle(q, 8, scales, groups)


def _gptq_config(**overrides):
    cfg = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True, "damp_percent": 0.01,
           "true_sequential": True, "quant_method": "gptq", "checkpoint_format": "gptq"}
    cfg.update(overrides)
    return {key: value for key, value in cfg.items() if value is not _DROP}


def _awq_config(**overrides):
    cfg = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
           "modules_to_not_convert": None}
    cfg.update(overrides)
    return {key: value for key, value in cfg.items() if value is not _DROP}


def _ct_config(group_size=128):
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    scheme.weights.group_size = group_size
    return json.loads(json.dumps(QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                                                    quantization_status="compressed",
                                                    ignore=["lm_head"]).model_dump(), default=str))


_DROP = object()


# ---- GPTQ

@pytest.mark.parametrize("checkpoint_format", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gptq_converts_to_the_documented_dequantization(group_size, act_order, checkpoint_format):
    g = torch.Generator().manual_seed(group_size + 2 * act_order)
    n, k = 24, 256
    tensors, expected = _gptq_layer(n, k, group_size, act_order, checkpoint_format, g)
    fmt = gptq.parse_config(_gptq_config(group_size=group_size, desc_act=act_order,
                                         checkpoint_format=checkpoint_format))
    weight = fmt.convert(tensors, k, n, torch.float16)
    assert weight.zeros is None and weight.scales.dtype == torch.float16
    assert (weight.g_idx is not None) == act_order  # the plain k // G g_idx is dropped
    torch.testing.assert_close(weight.dequantize(torch.float64), expected, rtol=0, atol=0)


def test_gptq_zero_point_offset_follows_checkpoint_format():
    """v1 stores zero - 1 (7 for the symmetric 8): read as v2, or v2 data read as v1, is refused rather
    than dequantized with every weight shifted by one step."""
    g = torch.Generator().manual_seed(3)
    v1, _ = _gptq_layer(8, 128, 128, False, "gptq", g)
    v2, _ = _gptq_layer(8, 128, 128, False, "gptq_v2", g)
    assert int(v1["qzeros"][0, 0]) == 0x77777777  # the documented v1 words of the symmetric zero point
    for tensors, label in ((v1, "gptq_v2"), (v2, "gptq")):
        with pytest.raises(ValueError, match="qzeros"):
            gptq.parse_config(_gptq_config(checkpoint_format=label)).convert(tensors, 128, 8, torch.float32)


def test_gptq_packs_along_k_lowest_nibble_first():
    """One known word: qweight[0, n] = 0x76543210 puts value i in column i of row n."""
    n, k = 8, 128
    qweight = torch.full((k // 8, n), 0x88888888, dtype=torch.int64)  # 8 everywhere: W = 0
    qweight[0, :] = 0x76543210
    tensors = {"qweight": _to_int32(qweight), "qzeros": torch.full((1, 1), 0x77777777, dtype=torch.int32),
               "scales": torch.ones(1, n, dtype=torch.float16)}
    weight = gptq.parse_config(_gptq_config()).convert(tensors, k, n, torch.float32)
    assert weight.dequantize(torch.float64)[:, :8].tolist() == [[i - 8.0 for i in range(8)]] * n


# ---- AWQ

@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_converts_to_the_documented_dequantization(group_size):
    g = torch.Generator().manual_seed(group_size)
    n, k = 32, 256
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(0, 16, (n, k // group_size), generator=g)
    scales = (torch.rand(n, k // group_size, generator=g) + 0.05).half()
    tensors = {"qweight": _along_n(q.t(), AWQ_PACK_ORDER), "qzeros": _along_n(zeros.t(), AWQ_PACK_ORDER),
               "scales": scales.t().contiguous()}
    weight = awq.parse_config(_awq_config(group_size=group_size)).convert(tensors, k, n, torch.bfloat16)
    assert weight.scales.dtype == torch.bfloat16 and weight.zeros.dtype == torch.uint8
    expected = _oracle(q, zeros, scales.bfloat16(), torch.arange(k) // group_size)
    torch.testing.assert_close(weight.dequantize(torch.float64), expected, rtol=0, atol=0)


def test_awq_undoes_the_interleave_of_one_known_word():
    """qweight[k, 0] = 0x76543210 (nibble i holds i): AWQ's order puts nibble i in row
    AWQ_PACK_ORDER[i], so rows 0..7 read 0, 4, 1, 5, 2, 6, 3, 7; a reader ignoring the interleave
    would see 0..7."""
    n, k = 8, 128
    tensors = {"qweight": torch.full((k, 1), 0x76543210, dtype=torch.int32),
               "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, n, dtype=torch.float16)}
    weight = awq.parse_config(_awq_config()).convert(tensors, k, n, torch.float32)
    assert weight.dequantize(torch.float64)[:, 0].tolist() == [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]


def test_awq_reads_autoawq_quant_config_spelling():
    fmt = awq.parse_config({"zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"})
    assert fmt.group_size == 64 and fmt.modules_to_not_convert == ()
    assert awq.parse_config(_awq_config(modules_to_not_convert=["visual"])).modules_to_not_convert == ("visual",)


# ---- compressed-tensors W4A16

@pytest.mark.parametrize("scale_dtype", [torch.float64, torch.bfloat16])
def test_ct_int4_matches_the_library_decompression(scale_dtype):
    g = torch.Generator().manual_seed(5)
    n, k = 16, 384
    values = torch.randint(-8, 8, (n, k), generator=g).to(torch.int8)
    scales = (torch.rand(n, k // 128, generator=g) + 0.05).to(scale_dtype)
    tensors = {"weight_packed": pack_to_int32(values, 4), "weight_scale": scales, "weight_shape": torch.tensor([n, k])}
    scheme = preset_name_to_scheme("W4A16", ["Linear"])
    library = PackedQuantizationCompressor.decompress(dict(tensors), scheme)["weight"]  # in the scale dtype
    fmt = ct_int4.parse_config(_ct_config())
    assert fmt.ignore == ("lm_head",)
    weight = fmt.convert(tensors, k, n, scale_dtype)
    torch.testing.assert_close(weight.dequantize(scale_dtype), library, rtol=0, atol=0)
    own = values.double() * scales.double().repeat_interleave(128, dim=1)  # signed int4 times its scale
    torch.testing.assert_close(weight.dequantize(torch.float64), own, rtol=0, atol=0)


# ---- refused configs and layers name their field

def _ct_with(path: str, value):
    cfg = _ct_config()
    node = cfg
    *parents, leaf = path.split(".")
    for key in parents:
        node = node[key]
    if value is _DROP:
        node.pop(leaf)
    else:
        node[leaf] = value
    return cfg


REFUSED_CONFIGS = [
    (gptq, _gptq_config(bits=8), "bits"),
    (gptq, _gptq_config(bits=_DROP), "bits"),
    (gptq, _gptq_config(group_size=-1), "group_size"),
    (gptq, _gptq_config(group_size=256), "group_size"),
    (gptq, _gptq_config(group_size=_DROP), "group_size"),
    (gptq, _gptq_config(sym=False), "sym"),
    (gptq, _gptq_config(desc_act="yes"), "desc_act"),
    (gptq, _gptq_config(checkpoint_format="marlin"), "checkpoint_format"),
    (gptq, _gptq_config(is_marlin_format=True), "is_marlin_format"),
    (gptq, _gptq_config(lm_head=True), "lm_head"),
    (gptq, _gptq_config(pack_dtype="int16"), "pack_dtype"),
    (gptq, _gptq_config(dynamic={"-:.*down_proj": {}}), "dynamic"),
    (gptq, _gptq_config(quant_method="awq"), "quant_method"),
    (awq, _awq_config(bits=3), "bits"),
    (awq, _awq_config(group_size=_DROP), "group_size"),
    (awq, _awq_config(group_size=100), "group_size"),
    (awq, _awq_config(version="gemv"), "version"),
    (awq, _awq_config(version="exllama"), "version"),
    (awq, _awq_config(zero_point=False), "zero_point"),
    (awq, _awq_config(backend="llm-awq"), "backend"),
    (ct_int4, _ct_with("config_groups.group_0.weights.num_bits", 8), "config_groups.group_0.weights.num_bits"),
    (ct_int4, _ct_with("config_groups.group_0.weights.type", "float"), "config_groups.group_0.weights.type"),
    (ct_int4, _ct_with("config_groups.group_0.weights.symmetric", False),
     "config_groups.group_0.weights.symmetric"),
    (ct_int4, _ct_with("config_groups.group_0.weights.strategy", "channel"),
     "config_groups.group_0.weights.strategy"),
    (ct_int4, _ct_with("config_groups.group_0.weights.group_size", 256), "config_groups.group_0.weights.group_size"),
    (ct_int4, _ct_with("config_groups.group_0.weights.actorder", "group"), "config_groups.group_0.weights.actorder"),
    (ct_int4, _ct_with("config_groups.group_0.weights", None), "config_groups.group_0.weights"),
    (ct_int4, _ct_with("config_groups.group_0.input_activations", {"num_bits": 8, "type": "int"}),
     "config_groups.group_0.input_activations"),
    (ct_int4, _ct_with("format", "float-quantized"), "format"),
    (ct_int4, _ct_with("quantization_status", "frozen"), "quantization_status"),
    (ct_int4, _ct_with("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (ct_int4, _ct_with("config_groups", _DROP), "config_groups"),
]


@pytest.mark.parametrize("module, qcfg, field", REFUSED_CONFIGS,
                         ids=[f"{m.__name__.rsplit('.', 1)[1]}-{f}-{i}"
                              for i, (m, _, f) in enumerate(REFUSED_CONFIGS)])
def test_unsupported_configs_are_refused_naming_the_field(module, qcfg, field):
    with pytest.raises(ValueError, match=rf"'{re.escape(field)}'"):
        module.parse_config(qcfg)


def test_ct_int4_refuses_groups_with_different_group_sizes():
    cfg = _ct_config()
    cfg["config_groups"]["group_1"] = json.loads(json.dumps(cfg["config_groups"]["group_0"]))
    cfg["config_groups"]["group_1"]["weights"]["group_size"] = 64
    with pytest.raises(ValueError, match="'config_groups'.*group_size"):
        ct_int4.parse_config(cfg)


def test_layers_that_do_not_fit_are_refused_naming_the_tensor():
    g = torch.Generator().manual_seed(7)
    fmt = gptq.parse_config(_gptq_config(desc_act=True))
    tensors, _ = _gptq_layer(8, 256, 128, True, "gptq", g)
    with pytest.raises(ValueError, match="group_size 128 must divide in_features 192"):
        fmt.convert(tensors, 192, 8, torch.float16)
    with pytest.raises(ValueError, match="'qweight'"):
        fmt.convert(tensors, 256, 16, torch.float16)
    with pytest.raises(ValueError, match="'g_idx' that desc_act"):
        fmt.convert({key: value for key, value in tensors.items() if key != "g_idx"}, 256, 8, torch.float16)
    uneven = dict(tensors, g_idx=torch.zeros(256, dtype=torch.int32))  # every column in group 0
    with pytest.raises(ValueError, match="'g_idx'.*each group"):
        fmt.convert(uneven, 256, 8, torch.float16)
    with pytest.raises(ValueError, match="'scales'"):
        fmt.convert(dict(tensors, scales=tensors["scales"].int()), 256, 8, torch.float16)
    with pytest.raises(ValueError, match="'qzeros'"):
        awq.parse_config(_awq_config()).convert({"qweight": torch.zeros(256, 1, dtype=torch.int32)}, 256, 8,
                                               torch.float16)
    ct = ct_int4.parse_config(_ct_config())
    packed = {"weight_packed": torch.zeros(8, 32, dtype=torch.int32), "weight_scale": torch.ones(8, 2),
              "weight_shape": torch.tensor([8, 128])}
    with pytest.raises(ValueError, match="'weight_shape'"):
        ct.convert(packed, 256, 8, torch.float16)
    with pytest.raises(ValueError, match="'weight_packed'"):
        ct.convert(dict(packed, weight_packed=packed["weight_packed"].float()), 256, 8, torch.float16)


# ---- a whole tiny checkpoint directory (for the end-to-end test once the loader reads 4-bit bases)

def _rtn_symmetric(w: torch.Tensor, groups: torch.Tensor, num_groups: int):
    """Round-to-nearest symmetric int4 of W [N, K] by column groups -> (q 0..15, scales fp16 [N, K/G])."""
    absmax = torch.stack([w[:, groups == i].abs().amax(1) for i in range(num_groups)], 1)  # [N, K/G]
    scales = (absmax / 7).clamp_min(1e-4).half()
    q = (torch.round(w / scales.float()[:, groups]) + 8).clamp(0, 15).long()
    return q, scales


def _rtn_asymmetric(w: torch.Tensor, group_size: int):
    """Round-to-nearest asymmetric int4 (AWQ's) -> (q, zeros 0..15, scales fp16 [N, K/G])."""
    n, k = w.shape
    grouped = w.reshape(n, k // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)  # [N, K/G]
    scales = ((high - low) / 15).clamp_min(1e-4).half()
    zeros = torch.round(-low / scales.float()).clamp(0, 15).long()
    groups = torch.arange(k) // group_size
    q = (torch.round(w / scales.float()[:, groups]) + zeros[:, groups]).clamp(0, 15).long()
    return q, zeros, scales


def write_int4_checkpoint(model, path, quant_method: str, group_size: int = 128, act_order: bool = False,
                          generator=None) -> dict[str, torch.Tensor]:
    """Write `model` (a transformers Llama) as a GPTQ (v1, symmetric) or AWQ (GEMM) checkpoint directory:
    config.json with its quantization_config and model.safetensors with every decoder-layer linear in the
    format's layout (round-to-nearest), everything else as it is. Returns the dequantized float32 weight of
    each quantized linear by its module name: loaded into the float model, that is the oracle."""
    path.mkdir(parents=True, exist_ok=True)
    tensors, dequantized = {}, {}
    for name, param in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if not (name.endswith(".weight") and ".layers." in name and param.dim() == 2):
            tensors[name] = param.detach().contiguous()
            continue
        w = param.detach().float()
        n, k = w.shape
        if quant_method == "gptq":
            groups = (_act_order_groups(k, group_size, generator) if act_order else torch.arange(k) // group_size)
            q, scales = _rtn_symmetric(w, groups, k // group_size)
            tensors |= {f"{module}.qweight": _gptq_qweight(q),
                        f"{module}.qzeros": _along_n(torch.full((k // group_size, n), 7), tuple(range(8))),
                        f"{module}.scales": scales.t().contiguous(), f"{module}.g_idx": groups.to(torch.int32)}
            dequantized[module] = _oracle(q, 8, scales, groups).float()
        else:
            q, zeros, scales = _rtn_asymmetric(w, group_size)
            tensors |= {f"{module}.qweight": _along_n(q.t(), AWQ_PACK_ORDER),
                        f"{module}.qzeros": _along_n(zeros.t(), AWQ_PACK_ORDER),
                        f"{module}.scales": scales.t().contiguous()}
            dequantized[module] = _oracle(q, zeros, scales, torch.arange(k) // group_size).float()
    qcfg = (_gptq_config(group_size=group_size, desc_act=act_order) if quant_method == "gptq"
            else _awq_config(group_size=group_size))
    config = model.config.to_dict() | {"quantization_config": qcfg}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return dequantized


@pytest.mark.parametrize("quant_method, act_order", [("gptq", False), ("gptq", True), ("awq", False)])
def test_tiny_checkpoint_directory_reads_back_layer_by_layer(tmp_path, quant_method, act_order):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(11)
    model = transformers.LlamaForCausalLM(config)
    dequantized = write_int4_checkpoint(model, tmp_path, quant_method, act_order=act_order,
                                        generator=torch.Generator().manual_seed(12))
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    fmt = {"gptq": gptq, "awq": awq}[quant_method].parse_config(qcfg)
    stored = load_file(str(tmp_path / "model.safetensors"))
    assert "model.embed_tokens.weight" in stored and "model.layers.0.self_attn.q_proj.weight" not in stored
    converted = {}
    for module, expected in dequantized.items():
        layer = {suffix: stored[f"{module}.{suffix}"] for suffix in fmt.suffixes + fmt.optional_suffixes
                 if f"{module}.{suffix}" in stored}
        out_features, in_features = expected.shape
        converted[module] = fmt.convert(layer, in_features, out_features, torch.float32)
        torch.testing.assert_close(converted[module].dequantize(torch.float64), expected.double(), rtol=0, atol=0)
        # the round trip is a real quantization of the float weight, not a copy
        original = model.get_submodule(module).weight.detach().double()
        assert 0 < (expected.double() - original).abs().max() < original.abs().max() / 4
    attention = "model.layers.0.self_attn"
    if not act_order:  # act-order slices carry different g_idx and cannot be packed
        qkv = Int4Weight.concat([converted[f"{attention}.{p}_proj"] for p in "qkv"])
        torch.testing.assert_close(qkv.dequantize(torch.float64),
                                   torch.cat([dequantized[f"{attention}.{p}_proj"] for p in "qkv"]).double())
