"""Base weights prepacked for the CPU GEMM: oneDNN's blocked layout, built once after loading.

On CPU, ``F.linear`` runs MKL's sgemm, which repacks the weight into its own panels on every call;
for the few rows of a decode step that repacking costs more than the multiplication. oneDNN (bundled
with torch) multiplies by a weight reordered once into its blocked layout, as vLLM's CPU backend
does. Measured with one thread on the ~100M model of benchmarks/bench_step.py (every weight of a
step in turn, so each is read from memory, not cache; ms per step of all base GEMMs):

| rows | 1 | 4 | 8 | 16 | 32 | 64 | 256 | 1024 |
|---|---|---|---|---|---|---|---|---|
| F.linear | 19.8 | 39.4 | 53.8 | 49.2 | 59.6 | 74.6 | 200.3 | 795.9 |
| packed | 20.4 | 21.8 | 25.4 | 31.7 | 41.9 | 64.1 | 192.5 | 803.1 |

The packed weight replaces the dense one (same bytes, no second copy); :func:`dense` gives the
[N, K] matrix back, bit-exact, for the rare readers (DoRA's weight norms). Only float32 weights on
CPU are packed, where torch has oneDNN; everything else keeps ``F.linear``. Results are not
bit-identical to ``F.linear`` (another summation order): float32 rounding, within the tolerances
every oracle comparison uses.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from punica_kernels import invariant


@functools.cache
def _available() -> bool:
    """Whether this torch has oneDNN's linear ops (x86 and Arm builds do)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def packable(weight: torch.Tensor) -> bool:
    """True for a 2-D float32 CPU weight when oneDNN is available."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and _available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 on CPU -> the same matrix in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias [N]) with W packed by :func:`pack` -> [T, N] (a plain strided tensor)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")


def dense(packed: torch.Tensor) -> torch.Tensor:
    """The packed weight as a plain [N, K] tensor (a new tensor, equal to what was packed)."""
    return packed.to_dense()


def matmul(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ W.T (+ bias) -> [T, N]: through ``packed`` when the weight was packed, else the
    dense ``weight`` [N, K] with F.linear (the linears' and the LM head's one dispatch). In the
    batch-invariant mode (punica_kernels.invariant) so that no row depends on T: fixed blocks of rows on
    CPU, the fixed-config Triton GEMM on CUDA (invariant.linear)."""
    if invariant.enabled():
        if packed is not None:
            return invariant.rows_matmul(x, lambda block: linear(block, packed, bias))
        return invariant.linear(x, weight, bias)
    if packed is not None:
        return linear(x, packed, bias)
    return F.linear(x, weight, bias)
