"""Per-slot scales of the LoRA delta, applied in the expand (both backends).

Per slot s, slice j (output columns cols_j) and LoRA token t of that slot, the expand computes

    y[t, cols_j] = c[s, cols_j] * y[t, cols_j] + (1 - c[s, cols_j]) * bias[cols_j]
                   + c[s, cols_j] * g[s, j] * inter[t, j] @ B[s, cols_j].T

``g`` (slice scales) is the adapter's LoRA scaling (lora_alpha / r, rsLoRA, patterns), applied to
the fp32 intermediate rather than folded into B (folding rounds B * scaling to fp16/bf16). ``c``
(column scales) is DoRA's m / ||W + g * B A|| per output row of the merged weight, 1 for plain LoRA;
it scales the base output and the delta, never the base bias (as PEFT). A missing ``g`` or ``c``
reads as 1 and a missing bias as 0; with c = 1 the result is y + delta, bit for bit.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Scales(NamedTuple):
    """Optional scales of one packed module's expand (see the module docstring)."""

    slices: torch.Tensor | None = None  # [max_loras, n_slices] float32 (float64 for float64 y): g
    columns: torch.Tensor | None = None  # [max_loras, N] float32 (float64 for float64 y): c
    bias: torch.Tensor | None = None  # [N] in y's dtype: the layer's bias, already inside y


NO_SCALES = Scales()
