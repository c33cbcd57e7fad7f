"""The batch-invariant mode's CUDA kernels: a GEMM and an RMSNorm whose reduction order never depends on M.

cuBLAS picks its algorithm (tile shape, split-K, a GEMV for one row) from the problem's M, and
torch's row reductions (``x.pow(2).mean(-1)``) pick threads per row and blocks per row from the
number of rows: the same row's sum comes out in another order in another batch. Here each kernel
has one configuration per dtype (the ``*_CONFIG`` tables), fixed whatever the number of rows:

* :func:`matmul`: one program per [BLOCK_M, BLOCK_N] output tile, K walked from 0 up in BLOCK_K
  steps into one fp32 accumulator (no split-K, no stream-K), the bias added in the epilogue. An
  output element's sum is then the same sequence of BLOCK_K-wide ``tl.dot`` steps whatever M is and
  wherever its row sits in its tile (tensor-core MMAs reduce each element the same way; the same
  assumption as Thinking Machines' batch_invariant_ops). M is not specialized: one binary for all.
* :func:`rms_norm`: one program per row, the whole row in one block: its sum of squares reduces in
  an order fixed by the row's width alone.

* :func:`softmax` (and its log): one program per row walking the row in BLOCK-wide chunks from column 0.
  torch's CUDA softmax also runs a block per row, but its vectorized loads start at each row's own
  16-byte boundary: with a vocabulary that is not a multiple of 4 a row's sum order follows its row
  index in the batch. The sampler's logprobs and sampling distributions take this one in the mode.

The mode's LoRA (punica_kernels.triton_ops with its K split fixed to one), attention
(lora_runner.model.paged_attention's prefill kernel for every token) and the sampler's scan and
selections (punica_kernels.invariant_sampling) are in their own modules.

CPU tensors run the interpreted twins (punica_kernels.triton_ops.kernel_for): the tile loops are
tested without a GPU (tests/test_batch_invariant_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_ops import kernel_for

# One tile config per element size, the only one the mode's GEMMs use: compiled without register
# spills for sm_80 and sm_90 (kernel_tools.aot.invariant_drivers, tests/test_batch_invariant_triton.py).
MATMUL_CONFIG = {2: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3),
                 4: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3)}
RMS_NORM_WARPS = 8
SOFTMAX_BLOCK, SOFTMAX_WARPS = 1024, 4  # columns per step of a row's softmax
# the combine function tl.sum reduces with, called through tl.reduce: the interpreted twins cannot call
# plain jit'd helpers such as tl.sum, only builtins and device_function ones (lora_runner.model.paged_attention)
_SUM = tl.standard._sum_combine


@triton.jit(do_not_specialize=["num_rows"])
def _matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr,
    num_rows, num_columns, num_features,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output columns
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_rows
    n_mask = offs_n < num_columns
    x_rows = offs_m.to(tl.int64) * stride_xm  # [BLOCK_M]
    w_rows = offs_n.to(tl.int64) * stride_wn  # [BLOCK_N]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    # K from 0 up in whole BLOCK_K steps, one accumulator: the order every element is summed in
    for k0 in range(0, num_features, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K]
        k_mask = k < num_features
        x_tile = tl.load(x_ptr + x_rows[:, None] + k[None, :].to(tl.int64) * stride_xk,
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w_tile = tl.load(w_ptr + w_rows[None, :] + k[:, None].to(tl.int64) * stride_wk,
                         mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x_tile, w_tile, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + (offs_m.to(tl.int64) * stride_om)[:, None] + (offs_n.to(tl.int64) * stride_on)[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: out = x @ weight.T (+ bias), fp32 accumulation, each row's bits independent of the others.

    x [M, K] fp16/bf16/fp32 (any strides); weight [N, K] in x's dtype (any strides); bias [N] or None.
    Returns a new [M, N] tensor in x's dtype. Grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), MATMUL_CONFIG's tiles.
    """
    num_rows, num_features = x.shape
    num_columns = weight.shape[0]
    assert weight.shape[1] == num_features and weight.dtype == x.dtype, (tuple(x.shape), tuple(weight.shape))
    assert bias is None or bias.shape == (num_columns,), "bias must be [N]"
    out = torch.empty(num_rows, num_columns, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    config = MATMUL_CONFIG[x.element_size()]
    grid = (triton.cdiv(num_rows, config["BLOCK_M"]), triton.cdiv(num_columns, config["BLOCK_N"]))
    kernel_for(_matmul_kernel, x.device)[grid](
        x, weight, out if bias is None else bias, out,  # the bias pointer is never read without HAS_BIAS
        num_rows, num_columns, num_features,
        *x.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None, DOT_PRECISION=_dot_precision(x.dtype), **config)
    return out


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, width, eps, stride_x, stride_o,
    BLOCK: tl.constexpr, UNIT_OFFSET: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    x32 = x.to(tl.float32)
    mean_square = tl.reduce(x32 * x32, 0, _SUM) / width  # one row, one block: an order set by BLOCK alone
    normed = x32 / tl.sqrt(mean_square + eps)
    weight = tl.load(w_ptr + offs, mask=mask, other=0.0)
    if UNIT_OFFSET:  # Gemma: x / rms * (1 + w), all in fp32, cast at the end
        out = normed * (1.0 + weight.to(tl.float32))
    else:  # w * (x / rms) cast to x's dtype first, as transformers' LlamaRMSNorm
        out = weight.to(tl.float32) * normed.to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """Semantics as lora_runner.model.layers.RMSNorm: y = w * x / sqrt(mean(x^2) + eps) (normalized in fp32,
    cast to x's dtype before the weight), or with unit_offset y = x / sqrt(mean(x^2) + eps) * (1 + w).

    x [..., width] fp16/bf16/fp32; weight [width] in x's dtype. Returns a new tensor shaped as x; one
    program per row, each row's bits independent of the others.
    """
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [rows, width]
    if rows.shape[0]:
        kernel_for(_rms_norm_kernel, x.device)[(rows.shape[0],)](
            rows, weight.contiguous(), out, width, eps, rows.stride(0), out.stride(0),
            BLOCK=triton.next_power_of_2(width), UNIT_OFFSET=unit_offset, num_warps=RMS_NORM_WARPS)
    return out.view(x.shape)


_MAX = tl.standard._elementwise_max


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, width, stride_x, stride_o, BLOCK: tl.constexpr, LOG: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row, out_row = x_ptr + row * stride_x, out_ptr + row * stride_o
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, width, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < width, other=float("-inf")).to(tl.float32)
        lane_max = tl.maximum(lane_max, x)
    row_max = tl.reduce(lane_max, 0, _MAX)  # a maximum: exact in any order
    lane_sum = tl.full([BLOCK], 0.0, tl.float32)
    for start in range(0, width, BLOCK):  # each lane adds its columns left to right, then one fixed tree
        x = tl.load(x_row + start + offs, mask=start + offs < width, other=float("-inf")).to(tl.float32)
        lane_sum += tl.exp(x - row_max)
    total = tl.reduce(lane_sum, 0, _SUM)
    for start in range(0, width, BLOCK):
        mask = start + offs < width
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            out = x - row_max - tl.log(total)
        else:
            out = tl.exp(x - row_max) / total
        tl.store(out_row + start + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def softmax(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """Semantics: torch.softmax(x, -1) (log: torch.log_softmax(x, -1)), accumulated in fp32.

    x [S, V] fp16/bf16/fp32. Returns a new [S, V] tensor in x's dtype; one program per row, each row's
    bits independent of the other rows and of where the row starts in memory.
    """
    rows = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)  # [S, V]
    if rows.shape[0]:
        kernel_for(_softmax_kernel, x.device)[(rows.shape[0],)](
            rows, out, rows.shape[1], rows.stride(0), out.stride(0), BLOCK=SOFTMAX_BLOCK, LOG=log,
            num_warps=SOFTMAX_WARPS)
    return out


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 as cuBLAS without TF32 (torch's default for matmuls): exact fp32 products; half inputs
    # multiply exactly on tensor cores whatever this says
    return "ieee" if dtype == torch.float32 else "tf32"
