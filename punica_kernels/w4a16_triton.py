"""The W4A16 GEMM in Triton: y = x @ W.T + bias with W a 4-bit weight dequantized in the kernel.

It reads exactly the one in-memory layout of 4-bit weights (lora_runner/model/quant/int4_layout.py):
``qweight`` int32 [N, K/8] (column 8j+i is nibble i of word j, lowest first), ``scales`` [N, K/G],
``zeros`` uint8 [N, K/G] or none (symmetric: 8), ``g_idx`` int32 [K] or none (column k in group k // G).
One kernel for every case (zero points, act-order, bias are constexpr variants):

* Grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)); each program walks K in BLOCK_K steps, fp32 accumulator.
* Each step loads BLOCK_K / 8 words per weight row once and unpacks them with shifts (no repeated
  word loads); int64 row offsets, integer offsets everywhere (no tensor of pointers).
* Without g_idx and with BLOCK_K dividing G, a step lies in one group: one scale and zero per weight row.
  Otherwise (act-order) each column gathers its own group's scale and zero. The tile is dequantized in
  fp32, rounded to x's dtype (as a dequantized weight would be) and multiplied with tl.dot.
* g_idx values outside [0, K/G) are clamped (never an out-of-bounds read); the loader checks them.

CPU tensors run under the Triton interpreter (no bf16 there), as punica_kernels.triton_ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .triton_ops import kernel_for

PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = tl.constexpr(8)  # a global a kernel reads must be a constexpr


@dataclass(frozen=True)
class TileConfig:
    """Block sizes, warps and pipeline stages of one launch; chosen from T and the dtype only (graph-stable)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3


# (largest T, config); None: any T. Half inputs: narrow output blocks for decode so a 4096-wide layer
# still has >= 128 programs, square-ish tiles for prefill. fp32 (tf32x3 dots, 3 passes) gets smaller
# tiles: the half ones spill registers there (tests/test_kernels_compile.py).
TILE_CONFIGS = ((16, TileConfig(16, 32, 128, 4)), (64, TileConfig(32, 64, 64, 4)),
                (None, TileConfig(64, 128, 64, 8)))
FP32_TILE_CONFIGS = ((16, TileConfig(16, 32, 32, 4)), (None, TileConfig(32, 32, 32, 4)))
# zero points or act-order (more loads per step) spill registers with the wider half tiles on sm_90
EXTRA_LOAD_TILE_CONFIGS = ((16, TileConfig(16, 32, 128, 4)), (64, TileConfig(32, 32, 64, 4)),
                           (None, TileConfig(64, 64, 64, 8)))


def tile_config(num_tokens: int, dtype: torch.dtype = torch.float16, extra_loads: bool = False) -> TileConfig:
    """The tile configuration for a batch of ``num_tokens`` rows of ``dtype`` (``extra_loads``: the
    weight has zero points or act-order)."""
    configs = (FP32_TILE_CONFIGS if dtype == torch.float32 else EXTRA_LOAD_TILE_CONFIGS if extra_loads
               else TILE_CONFIGS)
    for max_tokens, config in configs:
        if max_tokens is None or num_tokens <= max_tokens:
            return config
    raise AssertionError("the tile configs must end with a catch-all entry")


# the scale/zero row strides are K/G (7 for Qwen2's 896, 86 for Llama's 11008): specializing their
# 16-divisibility would double the compiled variants for loads of a few bytes per row
@triton.jit(do_not_specialize=["num_tokens", "stride_sn", "stride_zn"])
def _w4a16_kernel(
    x_ptr, qweight_ptr, scales_ptr, zeros_ptr, g_idx_ptr, bias_ptr, y_ptr,
    num_tokens, out_features, in_features,
    stride_xt, stride_xk, stride_qn, stride_qw, stride_sn, stride_sg, stride_zn, stride_zg, stride_yt, stride_yn,
    GROUP_SIZE: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output rows of W
    m_mask = offs_m < num_tokens
    n_mask = offs_n < out_features
    x_rows = offs_m.to(tl.int64) * stride_xt  # [BLOCK_M]
    q_rows = offs_n.to(tl.int64) * stride_qn  # [BLOCK_N]
    s_rows = offs_n.to(tl.int64) * stride_sn  # [BLOCK_N]
    z_rows = offs_n.to(tl.int64) * stride_zn  # [BLOCK_N]
    num_words = in_features // 8
    num_groups = in_features // GROUP_SIZE
    shifts = tl.arange(0, 8) * 4  # [8] nibble i of a word is bits 4i..4i+3
    offs_w = tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8] words of one step
    # one group per step: one scale (and zero) per weight row, not a gather per element
    ONE_GROUP_PER_STEP: tl.constexpr = (not HAS_G_IDX) and (GROUP_SIZE % BLOCK_K == 0)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = offs_k < in_features
        x_tile = tl.load(x_ptr + x_rows[:, None] + offs_k[None, :].to(tl.int64) * stride_xk,
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        words_k = k0 // 8 + offs_w  # [BLOCK_K / 8]
        words = tl.load(qweight_ptr + q_rows[:, None] + words_k[None, :].to(tl.int64) * stride_qw,
                        mask=n_mask[:, None] & (words_k < num_words)[None, :], other=0)  # [BLOCK_N, BLOCK_K/8]
        nibbles = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, BLOCK_K/8, 8]
        q = tl.reshape(nibbles, (BLOCK_N, BLOCK_K))  # [BLOCK_N, BLOCK_K] int32 in 0..15
        if ONE_GROUP_PER_STEP:
            group = k0 // GROUP_SIZE
            scale = tl.load(scales_ptr + s_rows + group * stride_sg, mask=n_mask, other=0.0)
            scale = scale.to(tl.float32)[:, None]  # [BLOCK_N, 1]
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + z_rows + group * stride_zg, mask=n_mask, other=0)
                zero = zero.to(tl.int32)[:, None]  # [BLOCK_N, 1]
            else:
                zero = SYMMETRIC_ZERO
        else:
            if HAS_G_IDX:
                groups = tl.load(g_idx_ptr + offs_k, mask=k_mask, other=0)
                groups = tl.minimum(tl.maximum(groups, 0), num_groups - 1)  # [BLOCK_K]
            else:
                groups = offs_k // GROUP_SIZE  # [BLOCK_K]
            nk_mask = n_mask[:, None] & k_mask[None, :]
            scale = tl.load(scales_ptr + s_rows[:, None] + groups[None, :].to(tl.int64) * stride_sg,
                            mask=nk_mask, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
            if HAS_ZEROS:
                zero = tl.load(zeros_ptr + z_rows[:, None] + groups[None, :].to(tl.int64) * stride_zg,
                               mask=nk_mask, other=0).to(tl.int32)  # [BLOCK_N, BLOCK_K]
            else:
                zero = SYMMETRIC_ZERO
        w = ((q - zero).to(tl.float32) * scale).to(x_tile.dtype)  # [BLOCK_N, BLOCK_K] dequantized
        acc = tl.dot(x_tile, tl.trans(w), acc, input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_yt + offs_n.to(tl.int64)[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None,
                 out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t, n] = sum_k x[t, k] * (q[n, k] - z[n, g_k]) * scales[n, g_k] + bias[n],
    g_k = g_idx[k] (or k // group_size), z = zeros (or 8), q the nibbles of qweight.

    x [T, K] fp16/bf16/fp32; qweight int32 [N, K/8]; scales [N, K/G] (any float dtype, read as fp32);
    zeros uint8 [N, K/G] or None; g_idx int32 [K] or None; bias [N] or None; out [T, N] in x's dtype
    (any strides), every element written. Arguments are checked by punica_kernels.w4a16. No allocation,
    no host sync: CUDA-graph safe. Grid (cdiv(T, BLOCK_M), cdiv(N, BLOCK_N)) by tile_config(T).
    """
    num_tokens, in_features = x.shape
    out_features = qweight.shape[0]
    if num_tokens == 0 or out_features == 0:
        return out
    config = tile_config(num_tokens, x.dtype, zeros is not None or g_idx is not None)
    grid = (triton.cdiv(num_tokens, config.block_m), triton.cdiv(out_features, config.block_n))
    # unused pointers get a tensor that is surely there (never read: the constexpr branch is compiled out)
    zeros_arg = zeros if zeros is not None else qweight
    stride_z = zeros.stride() if zeros is not None else (0, 0)
    kernel_for(_w4a16_kernel, x.device)[grid](
        x, qweight, scales, zeros_arg, g_idx if g_idx is not None else qweight,
        bias if bias is not None else x, out,
        num_tokens, out_features, in_features,
        *x.stride(), *qweight.stride(), *scales.stride(), *stride_z, *out.stride(),
        GROUP_SIZE=group_size, HAS_ZEROS=zeros is not None, HAS_G_IDX=g_idx is not None,
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        DOT_PRECISION="tf32x3" if x.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
