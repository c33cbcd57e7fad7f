"""GPU only (skipped without CUDA): compiled Triton kernels (SGMV, W4A16) and fp8_linear in bf16/fp16/fp32
against the float64 oracle, no host sync in the hot path, and replay of a CUDA graph captured with a single adapter."""

from __future__ import annotations

import pytest
import torch

from punica_kernels import LoRAMeta, TableLoader, add_lora, fp8, fp8_linear, load_table, w4a16_matmul
from test_kernels_fp8 import float64_reference, make_fp8_weight
from test_kernels_reference import POPULARITY, float64_add_lora, make_case, token_slots_for
from test_kernels_w4a16 import FORMATS, make_weight, oracle

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens,layout,popularity", [
    (1, "qkv_wide", "distinct"), (7, "down_wide", "mixed_none"), (64, "qkv", "skewed"),
    (300, "gate_up", "uniform"), (300, "qkv_wide", "identical"), (40, "o", "all_none"),
])
def test_compiled_add_lora(num_tokens, layout, popularity, dtype):
    case = make_case(num_tokens, layout, 64, popularity, mixed_ranks=True, seed=num_tokens,
                     dtype=dtype).to(dtype, "cuda")
    for with_ranks in (False, True):
        # room for K-split partials at small T, as in an engine sized for large batches
        meta = LoRAMeta(512, case.lora_a.shape[0], "cuda", max_rank=64,
                        max_slices=len(case.slice_sizes))
        load_table(meta, case.token_slots, case.slot_ranks if with_ranks else None)
        meta.workspace.fill_(float("nan"))
        y = case.y.clone()
        add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)  # auto -> triton
        expected = float64_add_lora(case.y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)
        tol = TOLERANCE[dtype]
        torch.testing.assert_close(y.double(), expected, rtol=tol, atol=tol)
        untouched = case.token_slots < 0
        assert torch.equal(y[untouched], case.y[untouched])


def test_add_lora_does_not_sync():
    """The table is loaded outside (on the engine's path it rides in the step's upload); the ops on a
    loaded meta never wait for the device."""
    case = make_case(64, "qkv", 16, "uniform", mixed_ranks=True).to(torch.bfloat16, "cuda")
    meta = LoRAMeta(64, 8, "cuda", max_rank=16, max_slices=3)
    load_table(meta, case.token_slots, case.slot_ranks)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)  # compile, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("num_tokens", [8, 48])
def test_cuda_graph_captured_with_one_adapter_replays_any_mix(num_tokens):
    """The SGLang #28371 failure mode: capture with one adapter, replay with many."""
    dtype, max_loras = torch.bfloat16, 8
    case = make_case(num_tokens, "qkv", 16, "identical", max_loras=max_loras, mixed_ranks=True,
                     seed=num_tokens).to(dtype, "cuda")
    meta = LoRAMeta(256, max_loras, "cuda", max_rank=16, max_slices=3)  # K-split at small T
    tables = TableLoader(meta)  # every load into the same device buffers: the ones the graph reads
    x, y = case.x.clone(), case.y.clone()  # persistent input/output buffers of the graph
    tables.load(torch.zeros(num_tokens, dtype=torch.int64, device="cuda"), case.slot_ranks)
    add_lora(y, x, case.lora_a, case.lora_b, meta, case.slice_sizes)  # eager: compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        add_lora(y, x, case.lora_a, case.lora_b, meta, case.slice_sizes)

    gen = torch.Generator().manual_seed(num_tokens)
    for popularity in POPULARITY:
        slots = token_slots_for(popularity, num_tokens, max_loras, gen).cuda()
        tables.load(slots, case.slot_ranks)  # outside the graph, into the same buffers
        x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
        y0 = torch.randn(y.shape, generator=gen).to(dtype).cuda()
        y.copy_(y0)
        graph.replay()
        torch.cuda.synchronize()
        expected = float64_add_lora(y0, x, case.lora_a, case.lora_b, meta, case.slice_sizes)
        torch.testing.assert_close(y.double(), expected, rtol=2e-2, atol=2e-2)
        assert torch.equal(y[slots < 0], y0[slots < 0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
@pytest.mark.parametrize("fmt", ["symmetric", "zeros", "act-order", "zeros+act-order"])
def test_compiled_w4a16_matmul(num_tokens, fmt, dtype):
    gen = torch.Generator().manual_seed(num_tokens)
    weight = make_weight(328, 1024, 128, *FORMATS[fmt], dtype, gen)
    x, bias = torch.randn(num_tokens, 1024, generator=gen).to(dtype), torch.randn(328, generator=gen).to(dtype)
    expected = oracle(x, weight, bias)
    cuda = [t.cuda() if t is not None else None for t in (x, weight.qweight, weight.scales, weight.zeros,
                                                          weight.g_idx, bias)]
    out = torch.full((num_tokens, 328), float("nan"), dtype=dtype, device="cuda")
    w4a16_matmul(*cuda[:5], weight.group_size, cuda[5], out=out)  # auto -> triton
    tol = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 1e-4}[dtype]
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 33, 256])
def test_fp8_linear_on_cuda(num_tokens, dtype):
    """_scaled_mm with per-token FP8 activations on sm_89+ (the dequantized product elsewhere), within
    FP8 activation rounding of the float64 product of the dequantized weight."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight, weight_scale = make_fp8_weight(512, 1024, gen)
    x, bias = torch.randn(num_tokens, 1024, generator=gen).to(dtype), torch.randn(512, generator=gen).to(dtype)
    expected = float64_reference(x, weight, weight_scale, bias)
    y = fp8_linear(x.cuda(), weight.cuda(), weight_scale.cuda(), bias.cuda())
    assert y.dtype == dtype and y.shape == (num_tokens, 512)
    assert fp8.uses_scaled_mm(x.cuda(), weight.cuda()) == (torch.cuda.get_device_capability() >= (8, 9))
    scale = expected.abs().max()
    assert (y.double().cpu() - expected).abs().max() < 0.05 * scale
