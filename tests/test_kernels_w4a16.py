"""The W4A16 GEMM (punica_kernels.w4a16_matmul) under the Triton interpreter (CPU tensors, fp32/fp16) and
its torch path, against a float64 oracle: x @ W.T + bias with W = Int4Weight.dequantize(float64) of the
one in-memory 4-bit layout (lora_runner/model/quant/int4_layout.py). Outputs are preallocated NaN buffers.
"""

from __future__ import annotations

import pytest
import torch

from lora_runner.model.quant.int4_layout import Int4Weight, pack_int4
from punica_kernels import reference, w4a16_matmul

pytest.importorskip("triton")

from punica_kernels import w4a16_triton  # noqa: E402

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
NAN = float("nan")
# (zero points, act-order g_idx): AWQ has zeros, GPTQ act-order has g_idx, both are supported together
FORMATS = {"symmetric": (False, False), "zeros": (True, False), "act-order": (False, True),
           "zeros+act-order": (True, True)}
# (N, K, group): N never a multiple of the output block; K = 200 with G = 40 is not a multiple of BLOCK_K;
# T = 100 reaches the prefill tile config
SHAPES = {1: (40, 384, 128), 3: (72, 200, 40), 17: (24, 256, 64), 64: (136, 384, 128), 100: (136, 256, 64)}


def make_weight(out_features: int, in_features: int, group_size: int, zeros: bool, act_order: bool,
                dtype: torch.dtype, gen: torch.Generator) -> Int4Weight:
    """A random 4-bit weight; act-order: every column in a random group, each group still G columns."""
    values = torch.randint(0, 16, (out_features, in_features), generator=gen)  # [N, K]
    groups = in_features // group_size
    scales = ((torch.rand(out_features, groups, generator=gen) + 0.5) * 0.5 * in_features ** -0.5).to(dtype)
    zero_points = torch.randint(0, 16, (out_features, groups), generator=gen).to(torch.uint8) if zeros else None
    g_idx = (torch.randperm(in_features, generator=gen) // group_size).to(torch.int32) if act_order else None
    weight = Int4Weight(pack_int4(values), scales, zero_points, g_idx, group_size)
    weight.check()
    return weight


def oracle(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.dequantize(torch.float64).T  # [T, N]
    return y + bias.double() if bias is not None else y


def run(x, weight: Int4Weight, bias, out=None, **kwargs) -> torch.Tensor:
    return w4a16_matmul(x, weight.qweight, weight.scales, weight.zeros, weight.g_idx, weight.group_size, bias,
                        out=out, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("num_tokens", list(SHAPES))
def test_triton_kernel_matches_float64_dequantized_reference(num_tokens, fmt, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 10 + list(FORMATS).index(fmt))
    out_features, in_features, group_size = SHAPES[num_tokens]
    weight = make_weight(out_features, in_features, group_size, *FORMATS[fmt], dtype, gen)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if num_tokens % 2 else None
    out = torch.full((num_tokens, out_features), NAN, dtype=dtype)
    assert run(x, weight, bias, out, backend="triton") is out
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), oracle(x, weight, bias), rtol=tol, atol=tol)


def test_every_tile_config_is_reached_with_both_scale_placements():
    """The shapes above cover each tile config with scales after the dot (one group per K step) and
    per column (act-order, or a group narrower than the step)."""
    reached = set()
    for num_tokens, (_, _, group_size) in SHAPES.items():
        config = w4a16_triton.tile_config(num_tokens)
        for _, act_order in FORMATS.values():
            reached.add((config, not act_order and group_size % config.block_k == 0))
    assert {config for config, _ in reached} == {config for _, config in w4a16_triton.TILE_CONFIGS}
    assert {after for _, after in reached} == {False, True}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_writes_only_its_columns_of_a_strided_output(backend):
    """out may be a column slice of a wider buffer (a packed projection's output): the rest stays NaN."""
    gen = torch.Generator().manual_seed(5)
    weight = make_weight(40, 256, 128, True, True, torch.float32, gen)
    x = torch.randn(5, 256, generator=gen)
    wide = torch.full((5, 100), NAN)
    run(x, weight, None, wide[:, 30:70], backend=backend)
    torch.testing.assert_close(wide[:, 30:70].double(), oracle(x, weight, None), rtol=2e-5, atol=2e-5)
    assert wide[:, :30].isnan().all() and wide[:, 70:].isnan().all()


def test_non_contiguous_input_rows():
    gen = torch.Generator().manual_seed(6)
    weight = make_weight(24, 128, 64, False, False, torch.float16, gen)
    x = torch.randn(7, 256, generator=gen).to(torch.float16)[:, ::2]  # stride 2 along K
    out = run(x, weight, None, torch.full((7, 24), NAN, dtype=torch.float16), backend="triton")
    torch.testing.assert_close(out.double(), oracle(x, weight, None), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_path_matches_the_oracle_and_float64_is_the_oracle(dtype):
    gen = torch.Generator().manual_seed(7)
    weight = make_weight(48, 256, 128, True, True, dtype, gen)
    x, bias = torch.randn(9, 256, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    expected = oracle(x, weight, bias)
    out = run(x, weight, bias, torch.full((9, 48), NAN, dtype=dtype), backend="torch")
    torch.testing.assert_close(out.double(), expected, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(run(x.double(), weight, bias.double()), expected, rtol=1e-12, atol=1e-12)


def test_auto_runs_torch_on_cpu_unless_triton_interpret_is_set(monkeypatch):
    gen = torch.Generator().manual_seed(8)
    weight = make_weight(16, 128, 128, False, False, torch.float32, gen)
    x = torch.randn(2, 128, generator=gen)
    launched = []
    real = w4a16_triton.w4a16_matmul
    monkeypatch.setattr(w4a16_triton, "w4a16_matmul", lambda *args: launched.append(1) or real(*args))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    run(x, weight, None)
    assert launched == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    y = run(x, weight, None)
    assert launched == [1]
    run(x.double(), weight, None)  # float64 (the oracle) always goes to torch
    run(x.bfloat16(), make_weight(16, 128, 128, False, False, torch.bfloat16, gen), None)  # no bf16 there
    assert launched == [1]
    torch.testing.assert_close(y.double(), oracle(x, weight, None), rtol=2e-5, atol=2e-5)


def test_out_of_range_g_idx_is_clamped_alike_in_kernel_and_torch_path():
    """Never an out-of-bounds read: both paths clamp a bad group index to the nearest group."""
    gen = torch.Generator().manual_seed(9)
    weight = make_weight(16, 128, 32, False, True, torch.float32, gen)
    weight.g_idx[:3] = torch.tensor([-5, 4, 1000], dtype=torch.int32)
    x = torch.randn(3, 128, generator=gen)
    clamped = Int4Weight(weight.qweight, weight.scales, None, weight.g_idx.clamp(0, 3), 32)
    for backend in ("triton", "torch"):
        torch.testing.assert_close(run(x, weight, None, backend=backend).double(), oracle(x, clamped, None),
                                   rtol=2e-5, atol=2e-5)


def test_packed_projection_equals_its_slices():
    """Int4Weight.concat (q, k, v -> qkv) through the kernel equals each slice alone."""
    gen = torch.Generator().manual_seed(10)
    parts = [make_weight(n, 256, 128, True, False, torch.float32, gen) for n in (32, 16, 16)]
    x = torch.randn(4, 256, generator=gen)
    packed = run(x, Int4Weight.concat(parts), None, backend="triton")
    torch.testing.assert_close(packed, torch.cat([run(x, p, None, backend="triton") for p in parts], 1),
                               rtol=1e-6, atol=1e-6)


def test_reference_dequantize_agrees_with_the_layout():
    gen = torch.Generator().manual_seed(11)
    weight = make_weight(8, 64, 16, True, True, torch.float32, gen)
    got = reference.w4a16_dequantize(weight.qweight, weight.scales, weight.zeros, weight.g_idx, 16, torch.float64)
    assert torch.equal(got, weight.dequantize(torch.float64))


BAD_ARGUMENTS = {
    "qweight int64": (lambda w, x: dict(qweight=w.qweight.long()), "qweight must be"),
    "qweight K mismatch": (lambda w, x: dict(qweight=w.qweight[:, :-1]), "qweight must have shape"),
    "scales shape": (lambda w, x: dict(scales=w.scales[:, :1]), "scales must have shape"),
    "scales int": (lambda w, x: dict(scales=w.scales.int()), "scales must be"),
    "zeros int32": (lambda w, x: dict(zeros=torch.zeros(w.scales.shape, dtype=torch.int32)), "zeros must be"),
    "g_idx length": (lambda w, x: dict(g_idx=torch.zeros(5, dtype=torch.int32)), "g_idx must have shape"),
    "g_idx int64": (lambda w, x: dict(g_idx=torch.zeros(128, dtype=torch.int64)), "g_idx must be"),
    "group not dividing K": (lambda w, x: dict(group_size=48), "group_size"),
    "group zero": (lambda w, x: dict(group_size=0), "group_size"),
    "bias dtype": (lambda w, x: dict(bias=torch.zeros(16, dtype=torch.float16)), "bias must be"),
    "bias shape": (lambda w, x: dict(bias=torch.zeros(17)), "bias must have shape"),
    "out shape": (lambda w, x: dict(out=torch.empty(2, 17)), "out must have shape"),
    "out dtype": (lambda w, x: dict(out=torch.empty(2, 16, dtype=torch.float16)), "out must be"),
    "x 1-D": (lambda w, x: dict(x=x[0]), "x must be"),
    "x int": (lambda w, x: dict(x=x.int()), "x must be"),
    "backend": (lambda w, x: dict(backend="cuda"), "backend must be"),
    "interpreter bf16": (lambda w, x: dict(x=x.bfloat16(), scales=w.scales.bfloat16(), backend="triton"),
                         "bfloat16"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_value_error(case):
    gen = torch.Generator().manual_seed(12)
    weight = make_weight(16, 128, 32, False, False, torch.float32, gen)
    x = torch.randn(2, 128, generator=gen)
    make, message = BAD_ARGUMENTS[case]
    args = dict(x=x, qweight=weight.qweight, scales=weight.scales, zeros=weight.zeros, g_idx=weight.g_idx,
                group_size=32, bias=None, out=None, backend="torch")
    args.update(make(weight, x))
    with pytest.raises(ValueError, match=message):
        w4a16_matmul(args.pop("x"), args.pop("qweight"), args.pop("scales"), args.pop("zeros"), args.pop("g_idx"),
                     args.pop("group_size"), args.pop("bias"), **args)
