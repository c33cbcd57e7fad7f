"""Device and dtype resolution ("auto" included), shared by the engine config, the KV cache and the loader."""

from __future__ import annotations

import torch

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


def resolve_device(device: torch.device | str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else goes through torch.device."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: expected 'auto', 'cpu', 'cuda', 'cuda:N'") from err


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """A torch.dtype or 'float32'/'float16'/'bfloat16'/'auto' (auto: bf16 on CUDA, else fp32)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        on_cuda = resolve_device(device).type == "cuda"
        resolved = torch.bfloat16 if on_cuda else torch.float32
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}: use a torch dtype or 'float32', 'float16', "
                         "'bfloat16', 'auto'")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {resolved}: use float32, float16 or bfloat16")
    return resolved
