"""The one in-memory layout of 4-bit weights (W4A16): every 4-bit checkpoint format (GPTQ, AWQ,
compressed-tensors pack-quantized) is converted to it at load, and the W4A16 kernels read only it.

For a linear layer y = x @ W.T with W [N, K] (N output rows, K input columns) and group size G:

- ``qweight`` int32 [N, K // 8]: row n, word j holds input columns 8j..8j+7; column 8j+i is the
  unsigned 4-bit value (qweight[n, j] >> (4 * i)) & 0xF (lowest nibble first).
- ``scales`` [N, K // G] in the activation dtype (fp16/bf16/fp32): one scale per row per group.
- ``zeros`` None (symmetric: the zero point is 8) or uint8 [N, K // G] holding 0..15.
- ``g_idx`` None (column k is in group k // G) or int32 [K]: the group of each input column
  (GPTQ's act-order); every group then still holds G columns.

W[n, k] = (q[n, k] - z[n, g]) * s[n, g] with g = g_idx[k] (or k // G) and z = zeros[n, g] (or 8).
Row-wise layout: slices of a packed projection (q, k, v -> qkv) concatenate along N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

PACK = 8  # 4-bit values per int32 word
SYMMETRIC_ZERO = 8


@dataclass
class Int4Weight:
    """A 4-bit weight in the layout of the module docstring."""

    qweight: torch.Tensor  # int32 [N, K // 8]
    scales: torch.Tensor  # [N, K // G]
    zeros: torch.Tensor | None  # uint8 [N, K // G] or None (symmetric)
    g_idx: torch.Tensor | None  # int32 [K] or None
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * PACK

    def check(self) -> None:
        """ValueError when the tensors do not form this layout (shapes, dtypes, group size)."""
        n, k = self.out_features, self.in_features
        if self.qweight.dtype != torch.int32 or self.qweight.dim() != 2:
            raise ValueError(f"qweight must be int32 [N, K/8], got {self.qweight.dtype} {tuple(self.qweight.shape)}")
        if self.group_size < 1 or k % self.group_size:
            raise ValueError(f"group_size {self.group_size} must divide in_features {k}")
        groups = k // self.group_size
        if tuple(self.scales.shape) != (n, groups):
            raise ValueError(f"scales must be [{n}, {groups}], got {tuple(self.scales.shape)}")
        if self.zeros is not None and (self.zeros.dtype != torch.uint8 or tuple(self.zeros.shape) != (n, groups)):
            raise ValueError(f"zeros must be uint8 [{n}, {groups}], got {self.zeros.dtype} {tuple(self.zeros.shape)}")
        if self.g_idx is not None and (self.g_idx.dtype != torch.int32 or tuple(self.g_idx.shape) != (k,)):
            raise ValueError(f"g_idx must be int32 [{k}], got {self.g_idx.dtype} {tuple(self.g_idx.shape)}")

    def unpack(self) -> torch.Tensor:
        """The 4-bit values as int32 [N, K] (0..15)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.qweight.device)  # [8]
        values = (self.qweight[:, :, None] >> shifts) & 0xF  # [N, K/8, 8]
        return values.reshape(self.out_features, self.in_features)

    def groups(self) -> torch.Tensor:
        """The group of each input column, int64 [K]."""
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(self.in_features, device=self.qweight.device) // self.group_size

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """W [N, K] in `dtype` (computed in float32, or float64 when asked: the tests' oracle)."""
        compute = torch.float64 if dtype == torch.float64 else torch.float32
        groups = self.groups()  # [K]
        q = self.unpack().to(compute)  # [N, K]
        s = self.scales.to(compute)[:, groups]  # [N, K]
        z = (self.zeros.to(compute)[:, groups] if self.zeros is not None
             else torch.full_like(q, float(SYMMETRIC_ZERO)))  # [N, K]
        return ((q - z) * s).to(dtype)

    @staticmethod
    def concat(parts: list[Int4Weight]) -> Int4Weight:
        """The slices of a packed projection stacked along N; ValueError when they cannot share one
        layout (different group sizes, symmetric mixed with zero points, different g_idx)."""
        first = parts[0]
        for part in parts[1:]:
            if part.group_size != first.group_size or (part.zeros is None) != (first.zeros is None):
                raise ValueError("packed projections must share group_size and symmetry to be packed")
            if (part.g_idx is None) != (first.g_idx is None) or (
                    part.g_idx is not None and not torch.equal(part.g_idx, first.g_idx)):
                raise ValueError("packed projections with different g_idx (act-order) cannot be packed")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return Int4Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                          first.g_idx, first.group_size)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """int values 0..15 [N, K] -> qweight int32 [N, K // 8] (the inverse of Int4Weight.unpack)."""
    n, k = values.shape
    if k % PACK:
        raise ValueError(f"in_features {k} must be a multiple of {PACK}")
    v = values.to(torch.int64).reshape(n, k // PACK, PACK) & 0xF  # [N, K/8, 8]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)  # [8]
    words = (v << shifts).sum(-1)  # [N, K/8] in 0..2^32-1
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Int4Format(Protocol):
    """One 4-bit checkpoint format (lora_runner.model.quant.gptq / awq / ct_int4), parsed from the
    checkpoint's ``quantization_config`` by the format module's ``parse_config(qcfg) -> Int4Format``
    (ValueError naming the field for anything it does not implement, before any weight is allocated)."""

    group_size: int
    suffixes: tuple[str, ...]  # the tensor-name suffixes of one linear layer, e.g. ("qweight", "qzeros", "scales")
    optional_suffixes: tuple[str, ...]  # those a layer may lack, e.g. ("g_idx",)
    scale_suffix: str  # the suffix of the scales tensor, e.g. "scales"

    def convert(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                dtype: torch.dtype) -> Int4Weight:
        """One linear layer's checkpoint tensors (by suffix) -> its Int4Weight (scales in `dtype`);
        ValueError naming the tensor when a shape, dtype or value does not fit the format."""
        ...
