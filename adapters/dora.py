"""DoRA served unmerged: the per-output-row scale of a module, computed once when the adapter loads.

PEFT's ``DoraLinearLayer`` (eval mode; dropout is the identity there) computes, for base weight W
[out, in], LoRA factors A, B, scaling s and magnitude m [out]:

    result = base(x) + (c - 1) * (x @ W.T) + c * s * B(A(x)),   c = m / ||W + s * B @ A||_row

where the row norm is a constant (detached) and the base bias is not scaled: the output is
``c * (x @ W.T + s * B A x) + bias``. This module computes c, one module's slice at a time
on the base weight's device, in row chunks, so no more than one chunk of one merged weight exists
at a time. The expand kernel then applies c in its epilogue (punica_kernels.scales).
"""

from __future__ import annotations

from typing import Callable

import torch

# (layer, module name) -> that LoRA-capable module's base weight [N, K] (LoRAModule.key), on the serving device
BaseWeight = Callable[[int, str], torch.Tensor]

# Elements of the merged weight W + s * B @ A materialized at once (fp32). On a CPU a chunk that
# stays in cache (1 MiB) halves the time of a 16 MiB one (measured, one thread); on a GPU, 64 MiB
# chunks keep the launches few (a 7B model's 224 modules in ~1,000 launches).
CPU_CHUNK_ELEMENTS = 1 << 18
DEVICE_CHUNK_ELEMENTS = 1 << 24


def dora_column_scale(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                      magnitude: torch.Tensor) -> torch.Tensor:
    """c = magnitude / ||weight + scaling * lora_b @ lora_a|| per output row, float32 on the CPU.

    Args:
        weight: [N_j, K] base weight rows of one slice, on the device the work runs on.
        lora_a: [r, K]; lora_b: [N_j, r]; magnitude: [N_j] (any device and float dtype; as in the
            adapter file, before any cast to the serving dtype).
    """
    device = weight.device
    lora_a = lora_a.to(device=device, dtype=torch.float32)  # [r, K]
    lora_b = lora_b.to(device=device, dtype=torch.float32) * scaling  # [N_j, r]
    norms = torch.empty(weight.shape[0], dtype=torch.float32, device=device)  # [N_j]
    chunk_elements = CPU_CHUNK_ELEMENTS if device.type == "cpu" else DEVICE_CHUNK_ELEMENTS
    rows = max(1, chunk_elements // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        chunk = slice(start, start + rows)
        merged = torch.addmm(weight[chunk].float(), lora_b[chunk], lora_a)  # [rows, K]
        norms[chunk] = torch.linalg.vector_norm(merged, dim=1)
    return (magnitude.to(device=device, dtype=torch.float32) / norms).cpu()
