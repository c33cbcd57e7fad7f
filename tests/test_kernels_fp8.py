"""fp8_linear on CPU (the dequantize-and-matmul path) against a float64 reference of the dequantized
weight, the per-token activation quantization the CUDA path feeds torch._scaled_mm, and argument checks."""

from __future__ import annotations

import pytest
import torch

from punica_kernels import fp8, fp8_linear

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def make_fp8_weight(out_features: int, in_features: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight float8_e4m3fn [N, K], weight_scale float32 [N]) quantized per output channel."""
    dense = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    scale = dense.abs().amax(1) / fp8.FP8_MAX  # [N]
    return (dense / scale[:, None]).to(fp8.FP8_DTYPE), scale


def float64_reference(x, weight, weight_scale, bias) -> torch.Tensor:
    y = x.double() @ (weight.double() * weight_scale.double()[:, None]).T
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,out_features,in_features", [(1, 48, 64), (3, 40, 72), (17, 16, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpu_path_matches_float64_dequantized_reference(num_tokens, out_features, in_features, dtype, with_bias):
    gen = torch.Generator().manual_seed(num_tokens)
    weight, weight_scale = make_fp8_weight(out_features, in_features, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    y = fp8_linear(x, weight, weight_scale, bias)
    assert y.dtype == dtype and y.shape == (num_tokens, out_features)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(y.double(), float64_reference(x, weight, weight_scale, bias), rtol=tol, atol=tol)
    assert not fp8.uses_scaled_mm(x, weight)  # CPU


def test_float64_input_is_the_exact_reference():
    gen = torch.Generator().manual_seed(1)
    weight, weight_scale = make_fp8_weight(32, 64, gen)
    x = torch.randn(5, 64, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(fp8_linear(x, weight, weight_scale), float64_reference(x, weight, weight_scale, None),
                               rtol=1e-12, atol=1e-12)


def test_per_token_quantization_scales_each_row_to_fp8_range():
    """The activation side of the CUDA path: each row's amax maps to 448, x ~= x_fp8 * scale within
    FP8 e4m3's rounding (3 mantissa bits: relative error <= 2^-4), zero rows stay zero (no NaN)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 5.0, 1.0])[:, None]
    x[3] = 0.0
    x_fp8, scale = fp8.quantize_per_token(x)
    assert x_fp8.dtype == fp8.FP8_DTYPE and scale.shape == (6, 1) and scale.dtype == torch.float32
    back = x_fp8.float() * scale
    assert not back.isnan().any() and (back[3] == 0).all()
    nonzero = torch.arange(6) != 3
    assert torch.equal(x_fp8.float().abs().amax(1)[nonzero], torch.full((5,), fp8.FP8_MAX))
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9).all()  # normal and subnormal steps


def test_emulated_scaled_mm_math_is_close_to_the_dequantized_product():
    """What _scaled_mm computes (FP8 x times FP8 W, fp32 accumulation, both scales after), emulated in
    float64 on CPU: within FP8 activation rounding of the dequantized product (here, not asserted tighter)."""
    gen = torch.Generator().manual_seed(3)
    weight, weight_scale = make_fp8_weight(64, 128, gen)
    x = torch.randn(8, 128, generator=gen)
    x_fp8, x_scale = fp8.quantize_per_token(x)
    emulated = (x_fp8.double() @ weight.double().T) * x_scale.double() * weight_scale.double()[None, :]
    reference = float64_reference(x, weight, weight_scale, None)
    assert (emulated - reference).abs().max() < 0.05 * reference.abs().max()


BAD_ARGUMENTS = {
    "weight bf16": (lambda w, s, x: dict(weight=w.bfloat16()), "weight must be float8_e4m3fn"),
    "weight K": (lambda w, s, x: dict(weight=w[:, :32]), "weight must be float8_e4m3fn"),
    "scale float16": (lambda w, s, x: dict(weight_scale=s.half()), "weight_scale must be float32"),
    "scale per tensor": (lambda w, s, x: dict(weight_scale=s[:1]), "weight_scale must be float32"),
    "bias dtype": (lambda w, s, x: dict(bias=torch.zeros(16, dtype=torch.float16)), "bias must be"),
    "bias shape": (lambda w, s, x: dict(bias=torch.zeros(8)), "bias must be"),
    "x 3-D": (lambda w, s, x: dict(x=x[None]), "x must be"),
    "x fp8": (lambda w, s, x: dict(x=x.to(fp8.FP8_DTYPE)), "x must be"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_value_error(case):
    gen = torch.Generator().manual_seed(4)
    weight, weight_scale = make_fp8_weight(16, 64, gen)
    args = dict(x=torch.randn(2, 64, generator=gen), weight=weight, weight_scale=weight_scale, bias=None)
    make, message = BAD_ARGUMENTS[case]
    args.update(make(weight, weight_scale, args["x"]))
    with pytest.raises(ValueError, match=message):
        fp8_linear(**args)
