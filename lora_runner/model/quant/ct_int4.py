"""compressed-tensors W4A16 checkpoints (``quant_method: "compressed-tensors"``, ``format:
"pack-quantized"``, the llm-compressor / RedHatAI int4 checkpoints) converted to the one in-memory
layout (int4_layout.Int4Weight).

Checkpoint layout of one linear layer y = x @ W.T, W [N, K], group size G (compressed-tensors'
``pack_to_int32`` with num_bits 4, packed_dim 1):

- ``weight_packed`` int32 [N, K // 8]: packed along K, lowest nibble first; each nibble is the
  signed int4 value plus 8 (so -8..7 is stored as 0..15).
- ``weight_scale`` [N, K // G] (the checkpoint's dtype, bf16 in practice).
- ``weight_shape`` int [2]: (N, K).

W[n, k] = (nibble - 8) * weight_scale[n, k // G]: exactly Int4Weight's symmetric layout, so the
words are kept as they are. Only symmetric int4 with strategy "group" and no activation quantization
is read; ``actorder: "weight"`` changes calibration only, not the stored format, and is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from lora_runner.model.quant.int4_layout import PACK, Int4Weight

SUPPORTED_GROUP_SIZES = (32, 64, 128)
STATIC_ACTORDERS = (None, "weight", "static")  # those that store no g_idx


def _refuse(field: str, message: str) -> ValueError:
    return ValueError(f"compressed-tensors quantization_config field {field!r}: {message}")


def _check_weights(field: str, weights: object) -> int:
    """One config group's weight QuantizationArgs -> its group size; ValueError naming the field."""
    if not isinstance(weights, dict):
        raise _refuse(field, "a W4A16 group needs its weight quantization arguments")
    expected = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group"}
    for key, value in expected.items():
        actual = weights.get(key)
        if actual != value or type(actual) is not type(value):  # type: 1 is not true, true is not 4
            raise _refuse(f"{field}.{key}", f"must be {value!r} (W4A16 pack-quantized), got {actual!r}")
    group_size = weights.get("group_size")
    if isinstance(group_size, bool) or group_size not in SUPPORTED_GROUP_SIZES:
        raise _refuse(f"{field}.group_size", f"must be one of {SUPPORTED_GROUP_SIZES}, got {group_size!r}")
    if weights.get("dynamic", False) is not False:
        raise _refuse(f"{field}.dynamic", "dynamic weight quantization is not supported")
    if weights.get("actorder") not in STATIC_ACTORDERS:
        raise _refuse(f"{field}.actorder", f"must be one of {STATIC_ACTORDERS} (no g_idx), "
                                           f"got {weights.get('actorder')!r}")
    if weights.get("block_structure") is not None:
        raise _refuse(f"{field}.block_structure", "block-wise weight scales are not supported")
    return group_size


def parse_config(qcfg: dict) -> CTInt4Format:
    """A compressed-tensors ``quantization_config`` whose every config group is W4A16 (int4,
    symmetric, strategy "group", no activation quantization) -> its CTInt4Format; ValueError naming
    the field for any other scheme, format or status, KV-cache / sparsity / transform schemes, config
    groups with different group sizes, or missing config groups."""
    method = qcfg.get("quant_method", "compressed-tensors")
    if method != "compressed-tensors":
        raise _refuse("quant_method", f"must be 'compressed-tensors', got {method!r}")
    status = qcfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("quantization_status", f"must be 'compressed' (packed weights), got {status!r}")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qcfg.get(field):
            raise _refuse(field, "is not supported")
    groups = qcfg.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse("config_groups", "a W4A16 checkpoint needs at least one config group")
    group_sizes = set()
    for name, scheme in groups.items():
        field = f"config_groups.{name}"
        if not isinstance(scheme, dict):
            raise _refuse(field, "must be a quantization scheme")
        fmt = scheme.get("format") or qcfg.get("format")
        if fmt != "pack-quantized":
            raise _refuse(f"{field}.format" if scheme.get("format") else "format",
                          f"must be 'pack-quantized', got {fmt!r}")
        for activations in ("input_activations", "output_activations"):
            if scheme.get(activations) is not None:
                raise _refuse(f"{field}.{activations}", "activation quantization is not supported with int4 weights")
        group_sizes.add(_check_weights(f"{field}.weights", scheme.get("weights")))
    if len(group_sizes) > 1:
        raise _refuse("config_groups", f"all groups must share one group_size, got {sorted(group_sizes)}")
    return CTInt4Format(group_size=group_sizes.pop(), ignore=tuple(qcfg.get("ignore") or ()))


def _expect(tensors: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if name not in tensors:
        raise ValueError(f"compressed-tensors layer lacks the tensor {name!r}")
    tensor = tensors[name]
    if tuple(tensor.shape) != shape:
        raise ValueError(f"compressed-tensors tensor {name!r} must have shape {list(shape)}, got {list(tensor.shape)}")
    return tensor


@dataclass(frozen=True)
class CTInt4Format:
    """compressed-tensors W4A16 pack-quantized (symmetric), parsed by ``parse_config``; ``convert``
    makes one layer's Int4Weight."""

    group_size: int
    ignore: tuple[str, ...] = ()  # the config's module names / "re:" patterns left unquantized (e.g. lm_head)
    suffixes: ClassVar[tuple[str, ...]] = ("weight_packed", "weight_scale", "weight_shape")
    optional_suffixes: ClassVar[tuple[str, ...]] = ()
    scale_suffix: ClassVar[str] = "weight_scale"  # the tensor holding the scales (named when it is not finite)
    # per tensor, (dim, rows or columns per element) along N and along K (tensor-parallel shards);
    # weight_shape is replaced by the shard's own (N, K)
    shard_axes: ClassVar[dict] = {"weight_packed": ((0, 1), (1, "pack")), "weight_scale": ((0, 1), (1, "group")),
                                  "weight_shape": (None, None)}

    def convert(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                dtype: torch.dtype) -> Int4Weight:
        """One layer's weight_packed / weight_scale / weight_shape -> Int4Weight (words unchanged,
        symmetric, scales in `dtype`); ValueError naming the tensor when a shape or dtype does not fit,
        or when the layer carries a zero point (an asymmetric layer in a symmetric config)."""
        k, n, g = in_features, out_features, self.group_size
        if k % g:
            raise ValueError(f"compressed-tensors group_size {g} must divide in_features {k}")
        if k % PACK:
            raise ValueError(f"compressed-tensors in_features {k} must be a multiple of {PACK}")
        if "weight_zero_point" in tensors:
            raise ValueError("compressed-tensors tensor 'weight_zero_point' in a symmetric W4A16 layer")
        packed = _expect(tensors, "weight_packed", (n, k // PACK))
        if packed.dtype != torch.int32:
            raise ValueError(f"compressed-tensors tensor 'weight_packed' must be int32, got {packed.dtype}")
        scale = _expect(tensors, "weight_scale", (n, k // g))
        if not scale.dtype.is_floating_point:
            raise ValueError(f"compressed-tensors tensor 'weight_scale' must be floating point, got {scale.dtype}")
        shape = _expect(tensors, "weight_shape", (2,))
        if [int(v) for v in shape] != [n, k]:
            raise ValueError(f"compressed-tensors tensor 'weight_shape' must be [{n}, {k}], got {shape.tolist()}")
        weight = Int4Weight(packed.contiguous(), scale.to(dtype).contiguous(), None, None, g)
        weight.check()
        return weight
