"""Per-slot scales in the expand (punica_kernels.scales): LoRA scaling per slot and slice on the fp32
intermediate, DoRA's column scale on base output and delta with the bias left unscaled.

Both backends against a per-token float64 loop; the rounding claim (scaling the fp32 intermediate
instead of folding the scaling into a half B) on Punica's add_lora test shape against float64.
"""

from __future__ import annotations

import pytest
import torch

from punica_kernels import LoRAMeta, add_lora, load_table, lora_expand, lora_shrink, reference
from test_kernels_reference import PATHS, make_case, prepared_meta

NAN = float("nan")


def make_scales(case, seed: int, plain_slots=(0,)) -> dict[str, torch.Tensor]:
    """Random slice scales [L, n] and column scales [L, N] (float64), and a bias [N] in y's dtype.

    ``plain_slots`` get column scale exactly 1 (plain LoRA next to DoRA adapters).
    """
    gen = torch.Generator().manual_seed(seed)
    max_loras, n_slices = case.lora_a.shape[:2]
    out_features = case.y.shape[1]
    slice_scales = 0.05 + 2 * torch.rand(max_loras, n_slices, generator=gen, dtype=torch.float64)
    column_scales = 0.5 + torch.rand(max_loras, out_features, generator=gen, dtype=torch.float64)
    column_scales[list(plain_slots)] = 1.0
    bias = torch.randn(out_features, generator=gen, dtype=torch.float64).to(case.y.dtype)
    return dict(slice_scales=slice_scales, column_scales=column_scales, bias=bias)


def cast_scales(scales: dict, dtype: torch.dtype) -> dict:
    """The scales as a caller in ``dtype`` passes them (float32, float64 for the oracle)."""
    compute = reference.compute_dtype(dtype)
    return {name: value.to(dtype if name == "bias" else compute) for name, value in scales.items()}


def naive_scaled(case, scales: dict) -> torch.Tensor:
    """Per-token float64 loop straight from the formula of punica_kernels.scales."""
    y = case.y.double().clone()  # [T, N]
    bias = scales["bias"].double()
    for t, slot in enumerate(case.token_slots.tolist()):
        if slot < 0:
            continue
        c = scales["column_scales"][slot].double()  # [N]
        offset = 0
        for j, width in enumerate(case.slice_sizes):
            cols = slice(offset, offset + width)
            inter = case.x[t].double() @ case.lora_a[slot, j].double().T  # [R]
            delta = scales["slice_scales"][slot, j] * inter @ case.lora_b[slot, cols].double().T
            y[t, cols] = c[cols] * y[t, cols] + (1 - c[cols]) * bias[cols] + c[cols] * delta
            offset += width
    return y


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_tokens,layout,popularity", [(1, "qkv", "distinct"), (9, "qkv", "mixed_none"),
                                                          (64, "gate_up", "skewed"), (40, "o", "uniform")])
def test_torch_scales_match_per_token_loop(path, num_tokens, layout, popularity):
    case = make_case(num_tokens, layout, 16, popularity, mixed_ranks=True, seed=num_tokens,
                     dtype=torch.float64)
    scales = make_scales(case, seed=num_tokens)
    meta = prepared_meta(case)
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes,
                       reference.Scales(scales["slice_scales"], scales["column_scales"], scales["bias"]),
                       path=path)
    expected = naive_scaled(case, scales)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])
    # the halves, through the public API
    inter = lora_shrink(case.x, case.lora_a, meta, backend="torch")
    y = case.y.clone()
    lora_expand(y, inter, case.lora_b, meta, case.slice_sizes, **scales, backend="torch")
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)


def test_column_scale_one_is_plain_lora_bit_for_bit():
    """A plain LoRA slot (column scale 1) next to DoRA slots gives exactly the unscaled result, bias
    or not; only slice scales of 1 are passed for it."""
    case = make_case(50, "qkv", 8, "uniform", seed=3, dtype=torch.float32)
    scales = cast_scales(make_scales(case, seed=3, plain_slots=range(8)), torch.float32)
    scales["slice_scales"].fill_(1.0)
    meta = prepared_meta(case)
    for backend in ("torch", "triton"):
        plain, scaled = case.y.clone(), case.y.clone()
        add_lora(plain, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend=backend)
        add_lora(scaled, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, **scales, backend=backend)
        assert torch.equal(scaled, plain), backend


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_scales_against_float64(dtype, with_bias):
    """Interpreter, with K-split partials (NaN-poisoned workspace) and slot ranks."""
    case = make_case(40, "qkv", 16, "mixed_none", mixed_ranks=True, seed=17, dtype=dtype)
    scales = make_scales(case, seed=17, plain_slots=(0, 3))
    if not with_bias:
        scales["bias"] = torch.zeros_like(scales["bias"])
    meta = prepared_meta(case, 512, with_ranks=True, max_rank=16, max_slices=3)
    meta.workspace.fill_(NAN)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes,
             **{**cast_scales(scales, dtype), **({} if with_bias else {"bias": None})}, backend="triton")
    tol = {torch.float32: 2e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), naive_scaled(case, scales), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_plain_lora_step_reads_no_column_scale_and_no_bias(dtype):
    """A step without DoRA slots passes slice scales only (lora_runner.model.layers.LoRALinear): the
    expand must then read neither column scales nor the bias (already inside y). The meta's unit
    scales, which fill the column-scale pointer, and the bias are NaN: any read of them shows."""
    case = make_case(40, "qkv", 16, "mixed_none", mixed_ranks=True, seed=23, dtype=dtype)
    scales = make_scales(case, seed=23, plain_slots=range(case.lora_a.shape[0]))  # column scales 1: plain LoRA
    meta = prepared_meta(case, 512, with_ranks=True, max_rank=16, max_slices=3)
    meta.workspace.fill_(NAN)
    meta.unit_scales(case.y.shape[1]).fill_(NAN)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="triton",
             slice_scales=scales["slice_scales"].float(), bias=torch.full_like(scales["bias"], NAN))
    tol = {torch.float32: 2e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), naive_scaled(case, {**scales, "bias": torch.zeros_like(scales["bias"])}),
                               rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


def test_triton_expand_half_with_scales():
    case = make_case(37, "gate_up", 8, "mixed_none", seed=4)
    scales = make_scales(case, seed=4)
    meta = prepared_meta(case)
    inter = lora_shrink(case.x, case.lora_a, meta, backend="triton")
    y = case.y.clone()
    lora_expand(y, inter, case.lora_b, meta, case.slice_sizes, **cast_scales(scales, torch.float32),
                backend="triton")
    torch.testing.assert_close(y.double(), naive_scaled(case, scales), rtol=2e-5, atol=2e-5)


BAD_SCALES = {
    "slice_scales shape": dict(slice_scales=torch.ones(8, 2)),
    "slice_scales dtype": dict(slice_scales=torch.ones(8, 3, dtype=torch.float16)),
    "column_scales shape": dict(column_scales=torch.ones(8, 100)),
    "column_scales 1-D": dict(column_scales=torch.ones(192)),
    "bias shape": dict(bias=torch.ones(100)),
    "bias dtype": dict(bias=torch.ones(192, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(BAD_SCALES))
def test_bad_scales_are_refused(name):
    case = make_case(6, "qkv", 4, "uniform", seed=1)
    meta = prepared_meta(case)
    with pytest.raises(ValueError, match=name.split()[0]):
        add_lora(case.y.clone(), case.x, case.lora_a, case.lora_b, meta, case.slice_sizes,
                 **BAD_SCALES[name], backend="torch")


# ------------------------------------------------- scaling on the fp32 intermediate vs folding

def punica_shape(num_tokens: int, in_features: int, out_features: int, seed: int = 0, device: str = "cpu"):
    """Punica's add_lora test data: fp16, randn x, y, A, B, rank 8, one adapter, scale 0.123."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen).half().to(device)  # noqa: E731
    x, y = rand(num_tokens, in_features), rand(num_tokens, out_features)
    lora_a, lora_b = rand(1, 1, 8, in_features), rand(1, out_features, 8)
    meta = LoRAMeta(num_tokens, 1, device)
    load_table(meta, torch.zeros(num_tokens, dtype=torch.int64, device=device))
    return x, y, lora_a, lora_b, meta


def fp32_intermediate_bound(x, y, lora_a, lora_b, scale):
    """(float64 exact result, per-element bound): half an fp16 ulp of the result for the final
    rounding, plus fp32's epsilon times the sum of the absolute terms for the fp32 work."""
    exact = y.double() + (x.double() @ lora_a[0, 0].double().T) @ lora_b[0].double().T * scale
    terms = (x.double().abs() @ lora_a[0, 0].double().abs().T) @ lora_b[0].double().abs().T * scale
    magnitude = y.double().abs() + terms
    binade = torch.exp2(torch.floor(torch.log2(exact.abs().clamp(min=2.0 ** -14))))
    half_ulp = binade * torch.finfo(torch.float16).eps / 2
    return exact, half_ulp + torch.finfo(torch.float32).eps * magnitude


def check_scale_precision(backend: str, x, y, lora_a, lora_b, meta) -> None:
    scale = 0.123
    exact, bound = fp32_intermediate_bound(x, y, lora_a, lora_b, scale)
    scaled = y.clone()
    add_lora(scaled, x, lora_a, lora_b, meta, (y.shape[1],), slice_scales=torch.full((1, 1), scale, device=y.device),
             backend=backend)
    error = (scaled.double() - exact).abs()
    assert (error <= bound).all(), f"{int((error > bound).sum())} outside, worst {float((error / bound).max()):.2f}x"
    assert not (error > 5e-3 + 5e-3 * exact.abs()).any()  # Punica's fp16 tolerance
    folded = y.clone()  # the scaling folded into B (rounded to fp16), as slots stored it before
    add_lora(folded, x, lora_a, lora_b * scale, meta, (y.shape[1],), backend=backend)
    assert ((folded.double() - exact).abs() > bound).sum() > 100  # the bound tells the two apart


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_scaling_on_fp32_intermediate_beats_folding_punica_shape(backend):
    """Punica's add_lora test shape (32 tokens, 4096 -> 11008, rank 8, fp16), full size."""
    check_scale_precision(backend, *punica_shape(32, 4096, 11008))


@pytest.mark.gpu
def test_compiled_scaling_on_fp32_intermediate_beats_folding_punica_shape():
    """The compiled expand (tf32x3 dot for half weights) keeps the fp32-intermediate bound."""
    check_scale_precision("triton", *punica_shape(32, 4096, 11008, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_scales_against_float64(dtype):
    case = make_case(300, "qkv_wide", 64, "mixed_none", mixed_ranks=True, seed=5, dtype=dtype)
    scales = make_scales(case, seed=5, plain_slots=(1,))
    gpu = case.to(dtype, "cuda")
    meta = LoRAMeta(512, case.lora_a.shape[0], "cuda", max_rank=64, max_slices=3)
    load_table(meta, gpu.token_slots, gpu.slot_ranks)
    y = gpu.y.clone()
    add_lora(y, gpu.x, gpu.lora_a, gpu.lora_b, meta, gpu.slice_sizes,
             **{k: v.cuda() for k, v in cast_scales(scales, dtype).items()})  # auto -> triton
    tol = {torch.bfloat16: 3e-2, torch.float16: 3e-3, torch.float32: 2e-5}[dtype]
    torch.testing.assert_close(y.cpu().double(), naive_scaled(case, scales), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y.cpu()[untouched], case.y[untouched])
