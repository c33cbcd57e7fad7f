"""The CPU base GEMM on prepacked weights (lora_runner.model.cpu_gemm): what load_model packs, that
the packed product is the float64 product within float32 rounding for every row count a step
sends, and that nothing keeps a second dense copy of a packed weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lora_runner.model import cpu_gemm, load_model
from lora_runner.model.layers import LoRALinear
from tests.factories import save_tiny_model

pytestmark = pytest.mark.skipif(not cpu_gemm.packable(torch.zeros(1, 1)), reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 3, 16, 67])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_is_the_float64_product(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=gen)  # [N, K]
    bias = torch.randn(96, generator=gen) if with_bias else None
    x = torch.randn(rows, 80, generator=gen)
    packed = cpu_gemm.pack(weight)
    got = cpu_gemm.linear(x, packed, bias)
    want = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.shape == (rows, 96) and got.dtype == torch.float32 and got.layout == torch.strided
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cpu_gemm.dense(packed), weight)  # the packed layout loses nothing


def test_packed_linear_reads_a_non_contiguous_input():
    gen = torch.Generator().manual_seed(1)
    weight, x = torch.randn(32, 40, generator=gen), torch.randn(40, 7, generator=gen).t()  # x [7, 40] transposed view
    torch.testing.assert_close(cpu_gemm.linear(x, cpu_gemm.pack(weight), None), x @ weight.t())


@pytest.mark.parametrize("tied", [False, True])
def test_load_model_packs_every_float32_linear_and_the_head_once(tmp_path, tied):
    hf = save_tiny_model(tmp_path, "llama", tokenizer=False, tie_word_embeddings=tied)
    model, _, _ = load_model(str(tmp_path))
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert linears and all(m.packed_weight is not None and m.weight is None for m in linears)  # one copy
    hf_layer = hf.model.layers[1]
    assert torch.equal(model.layers[1].mlp.down.base_weight(), hf_layer.mlp.down_proj.weight)
    qkv = torch.cat([getattr(hf_layer.self_attn, f"{p}_proj").weight for p in "qkv"])
    assert torch.equal(model.layers[1].self_attn.qkv.base_weight(), qkv)
    assert model.lm_head_packed is not None
    if tied:  # the embedding lookup still needs the dense rows
        assert model.lm_head is model.embed_tokens
    else:
        assert model.lm_head is None
    assert torch.equal(cpu_gemm.dense(model.lm_head_packed), hf.lm_head.weight)
    hidden = torch.randn(5, hf.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.compute_logits(hidden), hf.lm_head(hidden), rtol=1e-5, atol=1e-5)


def test_other_dtypes_keep_the_dense_gemm(tmp_path):
    save_tiny_model(tmp_path, "llama", tokenizer=False)
    model, _, _ = load_model(str(tmp_path), dtype="bfloat16")
    linears = [m for m in model.modules() if isinstance(m, LoRALinear)]
    assert all(m.packed_weight is None and m.weight.dtype == torch.bfloat16 for m in linears)
    assert model.lm_head_packed is None and model.lm_head is not None
