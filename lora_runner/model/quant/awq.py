"""AWQ 4-bit checkpoints in AutoAWQ's GEMM layout (``quant_method: "awq"``, ``version: "gemm"``)
converted to the one in-memory layout (int4_layout.Int4Weight).

Checkpoint layout of one linear layer y = x @ W.T, W [N, K], group size G:

- ``qweight`` int32 [K, N // 8]: packed along N; nibble i (bits 4i..4i+3) of word [k, j] holds row
  8j + AWQ_ORDER[i] of column k. AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7) is the interleave AutoAWQ's
  packer writes so that its CUDA kernel can unpack two halves at once.
- ``qzeros`` int32 [K // G, N // 8]: the zero points (0..15, no offset), packed the same way.
- ``scales`` [K // G, N] (fp16 in practice).

W[n, k] = (q[k, n] - zero[k // G, n]) * scales[k // G, n]. The converter undoes the interleave and
repacks along K (Int4Weight's qweight [N, K // 8]); the zero points are kept (AWQ is asymmetric).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lora_runner.model.quant.int4_layout import PACK, Int4Weight, pack_int4

SUPPORTED_GROUP_SIZES = (32, 64, 128)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds row AWQ_ORDER[i] of its 8
# row r of a word is in nibble AWQ_NIBBLE_OF_ROW[r] (the inverse permutation)
AWQ_NIBBLE_OF_ROW = tuple(AWQ_ORDER.index(row) for row in range(PACK))


def _field(qcfg: dict, names: tuple[str, ...], default=None, required: bool = False):
    """The first of `names` present (AutoAWQ's quant_config.json spells bits / group_size as
    w_bit / q_group_size, transformers' AwqConfig as bits / group_size)."""
    for name in names:
        if qcfg.get(name) is not None:
            return qcfg[name]
    if required:
        raise ValueError(f"awq quantization_config lacks the field {names[0]!r}")
    return default


def parse_config(qcfg: dict) -> AWQFormat:
    """An AWQ ``quantization_config`` -> its AWQFormat; ValueError naming the field for anything not
    implemented: bits other than 4, a group size not in SUPPORTED_GROUP_SIZES, a version other than
    "gemm" (gemv, gemv_fast, exllama, marlin, ipex repack the weights), ``zero_point: false``, a
    backend other than autoawq (llm-awq packs differently), missing bits or group_size."""
    method = _field(qcfg, ("quant_method",), "awq")
    if method != "awq":
        raise ValueError(f"awq quantization_config field 'quant_method' must be 'awq', got {method!r}")
    bits = _field(qcfg, ("bits", "w_bit"), required=True)
    if isinstance(bits, bool) or bits != 4:
        raise ValueError(f"awq quantization_config field 'bits' must be 4 (only 4-bit AWQ is read), got {bits!r}")
    group_size = _field(qcfg, ("group_size", "q_group_size"), required=True)
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"awq quantization_config field 'group_size' must be one of {SUPPORTED_GROUP_SIZES}, "
                         f"got {group_size!r}")
    version = _field(qcfg, ("version",), "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ValueError(f"awq quantization_config field 'version' must be 'gemm', got {version!r}")
    if _field(qcfg, ("zero_point",), True) is not True:
        raise ValueError("awq quantization_config field 'zero_point' must be true: AWQ GEMM without zero "
                         "points is not supported")
    backend = _field(qcfg, ("backend",), "autoawq")
    if backend != "autoawq":
        raise ValueError(f"awq quantization_config field 'backend' must be 'autoawq', got {backend!r}")
    return AWQFormat(group_size=group_size,
                     modules_to_not_convert=tuple(_field(qcfg, ("modules_to_not_convert",), ())))


def _unpack_interleaved(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] in AWQ's order -> int32 [R, C * 8] with column 8j + r = row r of word j."""
    shifts = torch.tensor([4 * nibble for nibble in AWQ_NIBBLE_OF_ROW], dtype=torch.int32,
                          device=words.device)  # [8]: the shift that reads row r
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)


def _expect(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...],
            floating: bool = False) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"awq layer lacks the tensor {name!r}")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"awq tensor {name!r} must have shape {list(shape)}, got {list(tensor.shape)}")
    if floating and not tensor.dtype.is_floating_point:
        raise ValueError(f"awq tensor {name!r} must be floating point, got {tensor.dtype}")
    if not floating and tensor.dtype != torch.int32:
        raise ValueError(f"awq tensor {name!r} must be int32, got {tensor.dtype}")
    return tensor


@dataclass(frozen=True)
class AWQFormat:
    """4-bit AWQ (GEMM layout, zero points), parsed by ``parse_config``; ``convert`` makes one
    layer's Int4Weight."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()  # module names the checkpoint keeps in full precision
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_suffixes: ClassVar[tuple[str, ...]] = ()
    scale_suffix: ClassVar[str] = "scales"  # the tensor holding the scales (named when it is not finite)
    # per tensor, (dim, rows or columns per element) along N and along K (tensor-parallel shards)
    shard_axes: ClassVar[dict] = {"qweight": ((1, "pack"), (0, 1)), "qzeros": ((1, "pack"), (0, "group")),
                                  "scales": ((1, 1), (0, "group"))}

    def convert(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                dtype: torch.dtype) -> Int4Weight:
        """One layer's qweight / qzeros / scales -> Int4Weight (repacked along K, zero points uint8,
        scales in `dtype`); ValueError naming the tensor when a shape or dtype does not fit."""
        k, n, g = in_features, out_features, self.group_size
        if k % g:
            raise ValueError(f"awq group_size {g} must divide in_features {k}")
        if n % PACK or k % PACK:
            raise ValueError(f"awq in_features {k} and out_features {n} must be multiples of {PACK}")
        qweight = _expect(tensors, "qweight", (k, n // PACK))
        qzeros = _expect(tensors, "qzeros", (k // g, n // PACK))
        scales = _expect(tensors, "scales", (k // g, n), floating=True)
        values = _unpack_interleaved(qweight)  # [K, N]
        zeros = _unpack_interleaved(qzeros)  # [K/G, N]
        weight = Int4Weight(pack_int4(values.t()), scales.t().to(dtype).contiguous(),
                            zeros.t().to(torch.uint8).contiguous(), None, g)
        weight.check()
        return weight
