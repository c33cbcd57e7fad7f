"""The fused MoE kernels (punica_kernels.moe_triton) with FP8 experts (quantization="fp8": float8_e4m3fn
weights, a float32 scale per (expert, output row)) under the Triton interpreter, fp32 and fp16, against the
float64 loop of punica_kernels.moe_reference over the dequantized weights; the FP8 block's fused path
(lora_runner.model.moe_fused) against its CPU grouped GEMM and a float block of the dequantized weights.
The interpreter loads the weights' bytes as the compiled kernel does (uint8, converted by a bit shift).
Helpers, inputs and the CUDA variants as tests/test_kernels_moe.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from punica_kernels.moe_align import moe_align  # noqa: E402
from punica_kernels.moe_reference import reference_moe  # noqa: E402
from punica_kernels.moe_triton import fused_moe, moe_gemm  # noqa: E402
from test_kernels_moe import (HIDDEN, INTERMEDIATE, NAN, TOLERANCE, _block_and_lora, _case,  # noqa: E402
                              _routing, _to)


def fp8_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts' W [E, N, K] -> (float8_e4m3fn [E, N, K], float32 scales [E, N]) per (expert, row), as the
    engine's online FP8 (lora_runner.model.moe_fp8)."""
    from lora_runner.model.quant.fp8 import quantize_per_channel

    quantized, scale = quantize_per_channel(weight.reshape(-1, weight.shape[-1]).float())
    return quantized.view(weight.shape), scale.view(weight.shape[:2])


def dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return weight.double() * scale.double()[:, :, None]  # [E, N, K] float64


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,top_k,with_lora", [(1, 2, False), (13, 2, True), (21, 3, False)])
def test_fused_moe_with_fp8_weights_matches_float64(num_tokens, top_k, with_lora, dtype):
    """FP8 experts (bytes converted in the kernel, scale per output channel on the accumulator), with and
    without expert LoRA, against the float64 loop over the dequantized weights; the scale is per channel
    (one per expert would be far off). Weights of rows far apart in magnitude, so a lost scale shows."""
    gen = torch.Generator().manual_seed(num_tokens * 7 + top_k)
    slot_ranks = torch.tensor([4, 16, 0, 20], dtype=torch.int32)
    token_slots = torch.tensor([0, 1, 3, -1])[torch.randint(0, 4, (num_tokens,), generator=gen)]
    x, w_gate_up, w_down, weights, experts, lora = _case(
        num_tokens, 6, top_k, True, torch.float32, seed=num_tokens, slots=token_slots if with_lora else None,
        slot_ranks=slot_ranks)
    row_sizes = torch.rand(6, 2 * INTERMEDIATE, 1, generator=gen) + 0.2  # [E, 2I, 1]: rows of unlike magnitude
    (q_gate_up, s_gate_up), (q_down, s_down) = fp8_experts(w_gate_up * row_sizes), fp8_experts(w_down)
    lora = None if lora is None else (lora[0], lora[1], *(tuple(t.to(dtype) for t in f) for f in lora[2:]))
    got = fused_moe(x.to(dtype), q_gate_up, q_down, weights, experts, lora, scales=(s_gate_up, s_down))
    clean = None if lora is None else (lora[0], lora[1], *(tuple(t.nan_to_num(0.0) for t in f) for f in lora[2:]))
    expected = reference_moe(x.to(dtype), dequantized(q_gate_up, s_gate_up), dequantized(q_down, s_down),
                             weights, experts, clean, stored=dtype)
    per_expert = s_gate_up.amax(dim=1, keepdim=True).expand_as(s_gate_up)  # [E, 2I] one scale per expert
    assert not torch.allclose(expected, reference_moe(x.to(dtype), dequantized(q_gate_up, per_expert),
                                                      dequantized(q_down, s_down), weights, experts, clean), atol=1e-2)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_gemm_writes_every_pair_with_its_experts_scales(dtype):
    """The FP8 GEMM (weighted, as down's) writes every pair's row (NaN-poisoned before) as
    a[p] @ (q[e] * s[e][:, None]).T * w[p]; the signed bytes, zeros and the smallest subnormals included."""
    num_tokens, top_k, num_experts = 11, 2, 5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    weight = torch.randn(num_experts, INTERMEDIATE, HIDDEN, generator=gen)
    q, scale = fp8_experts(weight)
    q[0, 0, :8] = torch.tensor([0.0, -0.0, 2.0 ** -9, -2.0 ** -9, 2.0 ** -7, 448.0, -448.0, 1.5]).to(q.dtype)
    _, experts = _routing(num_tokens, num_experts, top_k, True, gen)
    experts[0, 0] = 0
    pair_weights = torch.rand(num_tokens * top_k, generator=gen)
    out = torch.full((num_tokens * top_k, INTERMEDIATE), NAN, dtype=dtype)
    moe_gemm(x, q, out, moe_align(experts, num_experts, 16), top_k, pair_weights, weight_scale=scale)
    dense = dequantized(q, scale)
    expected = torch.stack([x[p // top_k].double() @ dense[experts.reshape(-1)[p]].T * pair_weights[p].double()
                            for p in range(num_tokens * top_k)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_fp8_block_fused_path_matches_its_torch_loop_and_dequantized_experts():
    """FP8 experts: the fused kernels (FP8 bytes, scales on the accumulator) equal the CPU's grouped GEMM over
    the experts it dequantizes, and both equal a float block holding the dequantized weights."""
    from lora_runner.model import moe_fused

    block, lora, gen = _block_and_lora(9, seed=2, fp8=True)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    weights, experts = block.route(hidden, None)
    assert block.experts[0].down.weight.dtype == torch.float8_e4m3fn
    for context in (None, lora):
        expected = block.routed_experts(hidden, weights, experts, context)  # CPU: the grouped GEMM
        got = moe_fused.fused_routed_experts(block, hidden, weights, experts, context)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    dense, _, _ = _block_and_lora(9, seed=2)
    with torch.no_grad():
        for ours, theirs in zip(block.experts, dense.experts):
            for projection in ("gate_up", "down"):
                getattr(theirs, projection).weight.copy_(getattr(ours, projection).base_weight())
        dense.router.weight.copy_(block.router.weight)
    torch.testing.assert_close(block.routed_experts(hidden, weights, experts, lora),
                               dense.routed_experts(hidden, weights, experts, lora), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [3, 300])
def test_compiled_fused_moe_with_fp8_weights_matches_float64(num_tokens, dtype):
    """The compiled FP8 GEMM variant (the bytes' bit conversion, on any GPU) with expert LoRA."""
    slot_ranks = torch.tensor([4, 16, 0, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(num_tokens)
    token_slots = torch.tensor([0, 1, 3, -1])[torch.randint(0, 4, (num_tokens,), generator=gen)]
    x, w_gate_up, w_down, weights, experts, lora = _case(num_tokens, 6, 2, True, dtype, seed=num_tokens,
                                                         slots=token_slots, slot_ranks=slot_ranks)
    (q_gate_up, s_gate_up), (q_down, s_down) = fp8_experts(w_gate_up), fp8_experts(w_down)
    got = fused_moe(*_to((x, q_gate_up, q_down, weights, experts, lora), "cuda"),
                    scales=_to((s_gate_up, s_down), "cuda"))
    clean = (lora[0], lora[1], *(tuple(t.nan_to_num(0.0) for t in factors) for factors in lora[2:]))
    expected = reference_moe(x, dequantized(q_gate_up, s_gate_up), dequantized(q_down, s_down), weights,
                             experts, clean, stored=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=tol)
