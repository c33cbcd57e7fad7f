"""The FP8 W8A8 linear: a float8_e4m3fn weight with per-output-channel scales times dynamic FP8 activations.

```
y = fp8_linear(x, weight, weight_scale, bias=None)   # y = x @ (weight * weight_scale[:, None]).T + bias
```
The in-memory layout: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N] (a per-tensor scale is
broadcast to [N] at load); W = weight.float() * weight_scale[:, None].

On CUDA with compute capability >= 8.9 (Ada, Hopper: FP8 tensor cores) and K, N multiples of 16
(cuBLASLt's FP8 constraint), x is quantized per row (token) to float8_e4m3fn with the scale
amax(|x[t]|) / 448 and multiplied by ``torch._scaled_mm``: bf16 outputs on sm_90+ use its fused
row-wise scaling (scale_a [T, 1], scale_b [1, N], the bias in the epilogue); other cases take unit
scales with a float32 output and the two scales applied after (row-wise scaling has bf16 output only,
and sm_90 only, on some torch builds). Elsewhere (CPU, older GPUs) the weight is dequantized for the
call in x's dtype and goes through F.linear (the weight stays FP8 in memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .meta import same_device

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448
MIN_SCALE = 1e-12  # an all-zero row gets this scale, not a division by zero
SCALED_MM_CAPABILITY = (8, 9)
ROWWISE_CAPABILITY = (9, 0)
SCALED_MM_ALIGNMENT = 16  # K and N of an FP8 cuBLASLt matmul
_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W.T + bias with W = weight.float() * weight_scale[:, None].

    Args:
        x: [T, K] float16, bfloat16, float32 (float64: the dequantized path, the oracle).
        weight: float8_e4m3fn [N, K].
        weight_scale: float32 [N], per output channel.
        bias: [N] in x's dtype, or None.

    Returns y [T, N] in x's dtype. On CUDA sm_89+ the activations are quantized to FP8 per token
    (dynamic scales), so y differs from the dequantized product by FP8's rounding of x; elsewhere it is
    the dequantized product in x's dtype.

    Raises:
        ValueError: shapes, dtypes or devices that do not match.
    """
    _check(x, weight, weight_scale, bias)
    if uses_scaled_mm(x, weight):
        return _scaled_mm_linear(x, weight, weight_scale, bias)
    return fp8_linear_dequantized(x, weight, weight_scale, bias)


def uses_scaled_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when fp8_linear takes torch._scaled_mm for these operands (CUDA sm_89+, aligned K and N)."""
    return (x.device.type == "cuda" and x.dtype != torch.float64
            and torch.cuda.get_device_capability(x.device) >= SCALED_MM_CAPABILITY
            and weight.shape[0] % SCALED_MM_ALIGNMENT == 0 and weight.shape[1] % SCALED_MM_ALIGNMENT == 0)


def fp8_linear_dequantized(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                           bias: torch.Tensor | None = None) -> torch.Tensor:
    """The portable path: W dequantized in float32 (float64 for float64 x), cast to x's dtype, F.linear."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    dequantized = (weight.to(compute) * weight_scale.to(compute)[:, None]).to(x.dtype)  # [N, K]
    return F.linear(x, dequantized, bias)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 float8_e4m3fn [T, K], scale float32 [T, 1]) with x ~= x_fp8.float() * scale, each row's
    amax mapped to FP8's largest value (dynamic per-token activation scales)."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # [T, 1]
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)  # [T, 1]
    x_fp8 = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [T, K]
    return x_fp8, scale


def _scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    x_fp8, x_scale = quantize_per_token(x)
    weight_t = weight.t()  # [K, N] column-major, as _scaled_mm wants its second operand
    if x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= ROWWISE_CAPABILITY:
        scale_b = weight_scale.reshape(1, -1).contiguous()  # [1, N]
        return torch._scaled_mm(x_fp8, weight_t, scale_a=x_scale, scale_b=scale_b, bias=bias,
                                out_dtype=torch.bfloat16)
    one = torch.ones((), dtype=torch.float32, device=x.device)
    y = torch._scaled_mm(x_fp8, weight_t, scale_a=one, scale_b=one, out_dtype=torch.float32)  # [T, N]
    y = y * x_scale * weight_scale.float()[None, :]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def _check(x, weight, weight_scale, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError("x must be a 2-D float16, bfloat16, float32 or float64 tensor [T, K]")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != FP8_DTYPE \
            or weight.shape[1] != x.shape[1]:
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be float8_e4m3fn [N, K={x.shape[1]}], got {got}")
    out_features = weight.shape[0]
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.dtype != torch.float32 \
            or tuple(weight_scale.shape) != (out_features,):
        got = (f"{weight_scale.dtype} {list(weight_scale.shape)}" if isinstance(weight_scale, torch.Tensor)
               else type(weight_scale).__name__)
        raise ValueError(f"weight_scale must be float32 [N={out_features}], got {got}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.dtype != x.dtype
                             or tuple(bias.shape) != (out_features,)):
        raise ValueError(f"bias must be [N={out_features}] in x's dtype {x.dtype}")
    for name, tensor in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if tensor is not None and not same_device(tensor.device, x.device):
            raise ValueError(f"{name} is on {tensor.device} but x is on {x.device}")
