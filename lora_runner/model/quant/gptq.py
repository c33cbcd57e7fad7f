"""GPTQ 4-bit checkpoints (AutoGPTQ / GPTQModel, ``quant_method: "gptq"``) converted to the one
in-memory layout (int4_layout.Int4Weight).

Checkpoint layout of one linear layer y = x @ W.T, W [N, K], group size G (all int32 words hold eight
4-bit values, lowest nibble first):

- ``qweight`` int32 [K // 8, N]: packed along K; word [j, n] holds W's columns 8j..8j+7 of row n.
- ``qzeros`` int32 [K // G, N // 8]: packed along N; word [g, j] holds the zero points of rows
  8j..8j+7 in group g. The v1 checkpoint format (``checkpoint_format: "gptq"``, the default and what
  the Hub holds) stores zero - 1 (a historical offset of AutoGPTQ's packer); ``"gptq_v2"`` stores zero.
- ``scales`` [K // G, N] (fp16 in practice).
- ``g_idx`` int32 [K] (optional): the group of each input column; with act-order (``desc_act``) it
  is a permutation of the groups, each group still holding G columns.

W[n, k] = (q[k, n] - zero[g, n]) * scales[g, n] with g = g_idx[k] (or k // G). Only symmetric
quantization is read (``sym: true``, the zero point is then 8 everywhere), so the layer converts to
an Int4Weight without zero points: qweight is GPTQ's qweight transposed, words unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lora_runner.model.quant.int4_layout import PACK, SYMMETRIC_ZERO, Int4Weight

SUPPORTED_GROUP_SIZES = (32, 64, 128)
# checkpoint_format -> what the stored zero point lacks (v1 stores zero - 1)
ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}


def _field(qcfg: dict, name: str, default=None, required: bool = False):
    if name not in qcfg or qcfg[name] is None:
        if required:
            raise ValueError(f"gptq quantization_config lacks the field {name!r}")
        return default
    return qcfg[name]


def parse_config(qcfg: dict) -> GPTQFormat:
    """A GPTQ ``quantization_config`` -> its GPTQFormat; ValueError naming the field for anything not
    implemented: bits other than 4, a group size not in SUPPORTED_GROUP_SIZES (-1, per-channel,
    included), ``sym: false``, a checkpoint_format other than gptq / gptq_v2 (Marlin repacks),
    words other than int32 (``pack_dtype``), a quantized lm_head, per-module ``dynamic`` overrides,
    missing bits or group_size."""
    method = _field(qcfg, "quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"gptq quantization_config field 'quant_method' must be 'gptq', got {method!r}")
    bits = _field(qcfg, "bits", required=True)
    if isinstance(bits, bool) or bits != 4:
        raise ValueError(f"gptq quantization_config field 'bits' must be 4 (only 4-bit GPTQ is read), got {bits!r}")
    group_size = _field(qcfg, "group_size", required=True)
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"gptq quantization_config field 'group_size' must be one of {SUPPORTED_GROUP_SIZES}, "
                         f"got {group_size!r}")
    if _field(qcfg, "sym", True) is not True:
        raise ValueError("gptq quantization_config field 'sym' must be true: asymmetric GPTQ is not supported")
    desc_act = _field(qcfg, "desc_act", False)
    if not isinstance(desc_act, bool):
        raise ValueError(f"gptq quantization_config field 'desc_act' must be true or false, got {desc_act!r}")
    checkpoint_format = _field(qcfg, "checkpoint_format", "gptq")
    if checkpoint_format not in ZERO_OFFSETS:
        raise ValueError(f"gptq quantization_config field 'checkpoint_format' must be one of "
                         f"{tuple(ZERO_OFFSETS)}, got {checkpoint_format!r}")
    if _field(qcfg, "is_marlin_format", False):
        raise ValueError("gptq quantization_config field 'is_marlin_format': Marlin-repacked GPTQ is not supported")
    pack_dtype = _field(qcfg, "pack_dtype", "int32")  # GPTQModel may pack into int16 / int8 words
    if pack_dtype != "int32":
        raise ValueError(f"gptq quantization_config field 'pack_dtype' must be 'int32', got {pack_dtype!r}")
    if _field(qcfg, "lm_head", False):
        raise ValueError("gptq quantization_config field 'lm_head': a quantized lm_head is not supported")
    if _field(qcfg, "dynamic", None):
        raise ValueError("gptq quantization_config field 'dynamic': per-module overrides are not supported")
    return GPTQFormat(group_size=group_size, desc_act=desc_act, zero_offset=ZERO_OFFSETS[checkpoint_format])


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int32 [R, C * 8]: the 4-bit values of each word, lowest nibble first."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)  # [8]
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)


def _expect(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...], floating: bool = False,
            dtype: torch.dtype | None = None) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"gptq layer lacks the tensor {name!r}")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"gptq tensor {name!r} must have shape {list(shape)}, got {list(tensor.shape)}")
    if dtype is not None and tensor.dtype != dtype:
        raise ValueError(f"gptq tensor {name!r} must be {dtype}, got {tensor.dtype}")
    if floating and not tensor.dtype.is_floating_point:
        raise ValueError(f"gptq tensor {name!r} must be floating point, got {tensor.dtype}")
    return tensor


def _check_g_idx(g_idx: torch.Tensor, in_features: int, group_size: int) -> None:
    if g_idx.dtype.is_floating_point or g_idx.dtype == torch.bool:
        raise ValueError(f"gptq tensor 'g_idx' must be integer, got {g_idx.dtype}")
    groups = in_features // group_size
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"gptq tensor 'g_idx' must hold groups 0..{groups - 1}")
    # The layout (and the kernels) rely on every group holding exactly G columns, as act-order writes it.
    counts = torch.bincount(g_idx.long(), minlength=groups)  # [K/G]
    if not bool((counts == group_size).all()):
        raise ValueError(f"gptq tensor 'g_idx' must put exactly group_size={group_size} columns in each group")


@dataclass(frozen=True)
class GPTQFormat:
    """Symmetric 4-bit GPTQ, parsed by ``parse_config``; ``convert`` makes one layer's Int4Weight."""

    group_size: int
    desc_act: bool  # act-order: every layer must carry its g_idx
    zero_offset: int  # added to the stored zero point (1 for the v1 checkpoint format)
    suffixes: ClassVar[tuple[str, ...]] = ("qweight", "qzeros", "scales")
    optional_suffixes: ClassVar[tuple[str, ...]] = ("g_idx",)
    scale_suffix: ClassVar[str] = "scales"  # the tensor holding the scales (named when it is not finite)
    # per tensor, (dim, rows or columns per element) along N and along K (tensor-parallel shards)
    shard_axes: ClassVar[dict] = {"qweight": ((1, 1), (0, "pack")), "qzeros": ((1, "pack"), (0, "group")),
                                  "scales": ((1, 1), (0, "group")), "g_idx": (None, (0, 1))}

    def convert(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                dtype: torch.dtype) -> Int4Weight:
        """One layer's qweight / qzeros / scales (/ g_idx) -> Int4Weight (scales in `dtype`, no zero
        points, g_idx kept only when it is not the plain k // G); ValueError naming the tensor when a
        shape, dtype or value does not fit (zero points other than 8 after the format's offset)."""
        k, n, g = in_features, out_features, self.group_size
        if k % g:
            raise ValueError(f"gptq group_size {g} must divide in_features {k}")
        if n % PACK:
            raise ValueError(f"gptq out_features {n} must be a multiple of {PACK} (qzeros pack 8 rows a word)")
        qweight = _expect(tensors, "qweight", (k // PACK, n), dtype=torch.int32)
        qzeros = _expect(tensors, "qzeros", (k // g, n // PACK), dtype=torch.int32)
        scales = _expect(tensors, "scales", (k // g, n), floating=True)
        zeros = _nibbles(qzeros) + self.zero_offset  # [K/G, N]
        if not bool((zeros == SYMMETRIC_ZERO).all()):
            raise ValueError(f"gptq tensor 'qzeros' must hold the symmetric zero point {SYMMETRIC_ZERO} "
                             f"(stored as {SYMMETRIC_ZERO - self.zero_offset} in this checkpoint_format); "
                             "check checkpoint_format and sym")
        g_idx = tensors.get("g_idx")
        if g_idx is None and self.desc_act:
            raise ValueError("gptq layer lacks the tensor 'g_idx' that desc_act (act-order) requires")
        if g_idx is not None:
            g_idx = _expect(tensors, "g_idx", (k,))
            _check_g_idx(g_idx, k, g)
            g_idx = g_idx.to(torch.int32)
            if torch.equal(g_idx, torch.arange(k, dtype=torch.int32, device=g_idx.device) // g):
                g_idx = None  # the plain grouping AutoGPTQ writes without act-order: no gather needed
        weight = Int4Weight(qweight.t().contiguous(), scales.t().to(dtype).contiguous(), None, g_idx, g)
        weight.check()
        return weight
