"""The public W4A16 GEMM: argument validation and backend dispatch (Triton or torch).

```
y = w4a16_matmul(x, qweight, scales, zeros, g_idx, group_size, bias=None)   # y = x @ W.T + bias
```
W is a 4-bit weight in the one in-memory layout (lora_runner/model/quant/int4_layout.py, fields of
``Int4Weight``). ``backend="auto"`` runs the Triton kernel (punica_kernels.w4a16_triton) on CUDA and, on
CPU, only when ``TRITON_INTERPRET=1`` is set (the interpreter: fp16/fp32); otherwise the torch path of
punica_kernels.reference (the weight dequantized for the call only). float64 always goes to torch (the
oracle). Validation reads shapes, dtypes and devices only: no host sync, no allocation given ``out``.
"""

from __future__ import annotations

import os

import torch

from . import ops, reference
from .meta import same_device

try:
    from . import w4a16_triton
except ImportError:  # no triton: _resolve never picks it then
    w4a16_triton = None

_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 g_idx: torch.Tensor | None, group_size: int, bias: torch.Tensor | None = None, *,
                 out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """y = x @ W.T + bias for a 4-bit weight W [N, K], dequantized inside the kernel.

    Semantics: out[t, n] = sum_k x[t, k] * (q[n, k] - z[n, g_k]) * scales[n, g_k] + bias[n], where
    q[n, k] = (qweight[n, k // 8] >> 4 * (k % 8)) & 0xF, g_k = g_idx[k] (or k // group_size) and
    z = zeros (or 8, symmetric). fp32 accumulation.

    Args:
        x: [T, K] float16, bfloat16, float32 (float64 on torch only).
        qweight: int32 [N, K // 8].
        scales: [N, K // group_size], float16/bfloat16/float32 (x's dtype in the engine).
        zeros: uint8 [N, K // group_size] zero points 0..15, or None (symmetric: 8).
        g_idx: int32 [K] group of each input column (GPTQ act-order), or None. Values must lie in
            [0, K // group_size) (not read here: that would sync; out-of-range values are clamped).
        group_size: input columns per group; divides K.
        bias: [N] in x's dtype, or None.
        out: [T, N] in x's dtype to write into (every element is written), or None to allocate.
        backend: "auto", "triton" or "torch".

    Returns out. The Triton path allocates nothing given ``out`` and never syncs: CUDA-graph safe.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, a group size that does not divide K.
        BackendUnavailableError: backend="triton" without an importable Triton.
    """
    _check(x, qweight, scales, zeros, g_idx, group_size, bias)
    if out is None:
        out = x.new_empty((x.shape[0], qweight.shape[0]))
    _check_out(out, x, qweight.shape[0])
    if _resolve(backend, x) == "torch":
        return reference.w4a16_matmul(x, qweight, scales, zeros, g_idx, group_size, bias, out)
    return w4a16_triton.w4a16_matmul(x, qweight, scales, zeros, g_idx, group_size, bias, out)


def _resolve(backend: str, x: torch.Tensor) -> str:
    """ops' dispatch, plus: "auto" on CPU runs the interpreter when TRITON_INTERPRET=1 asks for it."""
    if (backend == "auto" and x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
            and w4a16_triton is not None and x.dtype in (torch.float16, torch.float32)):
        return "triton"
    return ops._resolve(backend, x)


def _check(x, qweight, scales, zeros, g_idx, group_size, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError("x must be a 2-D float16, bfloat16, float32 or float64 tensor [T, K]")
    num_features = x.shape[1]
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 \
            or num_features % group_size or num_features % 8:
        raise ValueError(f"group_size {group_size!r} must be a positive int dividing K={num_features} "
                         "(itself a multiple of 8)")
    groups = num_features // group_size
    _check_operand("qweight", qweight, x, (None, num_features // 8), (torch.int32,))
    out_features = qweight.shape[0]
    _check_operand("scales", scales, x, (out_features, groups), _ACTIVATION_DTYPES)
    if zeros is not None:
        _check_operand("zeros", zeros, x, (out_features, groups), (torch.uint8,))
    if g_idx is not None:
        _check_operand("g_idx", g_idx, x, (num_features,), (torch.int32,))
    if bias is not None:
        _check_operand("bias", bias, x, (out_features,), (x.dtype,))


def _check_operand(name: str, tensor, x: torch.Tensor, shape: tuple, dtypes: tuple) -> None:
    """shape: expected sizes, None for any."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(tensor.shape, shape)):
        expected = ", ".join("*" if s is None else str(s) for s in shape)
        got = list(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"{name} must have shape [{expected}], got {got}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {tensor.dtype}")
    if not same_device(tensor.device, x.device):
        raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")


def _check_out(out, x: torch.Tensor, out_features: int) -> None:
    _check_operand("out", out, x, (x.shape[0], out_features), (x.dtype,))
