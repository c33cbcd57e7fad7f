"""Linear methods: how a LoRA-aware linear (lora_runner.model.layers.LoRALinear) holds its base weight
and multiplies by it: unquantized, FP8 (lora_runner.model.quant.fp8) or W4A16 (int4_layout.Int4Weight).

A method is stateless; the tensors live on the layer (``create_weights`` registers them, ``load`` fills
them from the checkpoint tensors of each packed slice, ``after_loading`` converts them once for the
device's GEMM, ``apply`` computes x @ W.T + b, ``dequantize`` gives W [N, K] for DoRA's norms). On CUDA
the kernels of punica_kernels run (``fp8_linear``: torch._scaled_mm on sm_89+; ``w4a16_matmul``:
Triton); elsewhere, and on CPU, each layer is dequantized on the fly: the weights stay quantized in
memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import punica_kernels
from lora_runner.model import cpu_gemm
from lora_runner.model.quant import fp8
from lora_runner.model.quant.config import QuantConfig
from lora_runner.model.quant.fp8 import Fp8Format
from lora_runner.model.quant.int4_layout import Int4Format, Int4Weight


# one slice of a packed projection as the checkpoint holds it: (checkpoint name prefix such as
# "model.layers.0.self_attn.q_proj", {suffix: tensor}, output rows)
CheckpointSlice = tuple[str, dict[str, torch.Tensor], int]


def _offsets(parts: list[CheckpointSlice]) -> list[int]:
    return [sum(size for _, _, size in parts[:i]) for i in range(len(parts))]


class UnquantizedLinear:
    """W in the model dtype as the parameter ``weight`` [N, K], loaded slice by slice by the model.

    After loading (:meth:`after_loading`) a float32 CPU weight moves into oneDNN's blocked layout
    (``packed_weight``, lora_runner.model.cpu_gemm) and ``weight`` becomes None: one copy either way."""

    quantized = False
    suffixes: tuple[str, ...] = ("weight",)
    optional_suffixes: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype,
                       device) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device),
                                    requires_grad=False)  # [N, K]
        layer.packed_weight = None  # [N, K] in oneDNN's layout once after_loading packed it

    def after_loading(self, layer: nn.Module) -> None:
        """Pack the loaded weight for the CPU GEMM when it can be (float32 on CPU); no-op otherwise."""
        if layer.packed_weight is None and cpu_gemm.packable(layer.weight):
            layer.packed_weight = cpu_gemm.pack(layer.weight)
            layer.weight = None  # the packed copy is the weight now

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return cpu_gemm.matmul(x, layer.weight, layer.packed_weight, bias)  # [T, N]

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        if layer.packed_weight is not None:
            return cpu_gemm.dense(layer.packed_weight)
        return layer.weight


class Fp8Linear:
    """FP8 weights: buffers ``weight`` float8_e4m3fn [N, K] and ``weight_scale`` float32 [N]."""

    quantized = True

    def __init__(self, form: Fp8Format):
        self.form = form
        self.suffixes = form.suffixes
        self.optional_suffixes: tuple[str, ...] = ()

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype,
                       device) -> None:
        layer.register_buffer("weight", torch.empty(out_features, in_features, dtype=fp8.FP8_DTYPE, device=device))
        layer.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))

    def row_max(self, layer: nn.Module) -> fp8.RowMax | None:
        """Where online quantization takes each row's maximum from (fp8.quantize_per_channel): None for a
        layer holding whole rows; over every rank for a row-parallel shard (``layer.reduce``: one
        all-reduce per layer at load), so its scales are those of one rank."""
        reduce = getattr(layer, "reduce", None)
        return None if reduce is None else (lambda amax: reduce.all_reduce(amax, op="max"))

    def load(self, layer: nn.Module, parts: list[CheckpointSlice]) -> None:
        """Convert each slice's checkpoint tensors and write them at the slice's rows (in place: the layer's
        buffers may be views of a larger one, as an MoE block's stacked experts), quantizing online with
        each row's maximum from :meth:`row_max`."""
        row_max = self.row_max(layer)
        for offset, (name, tensors, size) in zip(_offsets(parts), parts):
            weight, scale = self.form.convert(tensors, layer.in_features, size, name, row_max)
            layer.weight[offset:offset + size].copy_(weight)
            layer.weight_scale[offset:offset + size].copy_(scale)

    def after_loading(self, layer: nn.Module) -> None:
        """Nothing: the weight stays quantized (dequantized per call off CUDA)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda and self.form.dynamic_activations:
            return punica_kernels.fp8_linear(x, layer.weight, layer.weight_scale, bias)  # [T, N]
        return F.linear(x, fp8.dequantize(layer.weight, layer.weight_scale, x.dtype), bias)  # [T, N]

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return fp8.dequantize(layer.weight, layer.weight_scale, layer.dtype)


class Int4Linear:
    """W4A16: the layer's Int4Weight tensors as buffers ``qweight``, ``scales``, ``zeros``, ``g_idx``
    (set at load: whether there are zero points and act-order is the checkpoint's)."""

    quantized = True

    def __init__(self, form: Int4Format):
        self.form = form
        self.suffixes = tuple(form.suffixes)
        self.optional_suffixes = tuple(form.optional_suffixes)

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype,
                       device) -> None:
        for name in ("qweight", "scales", "zeros", "g_idx"):
            layer.register_buffer(name, None)

    def load(self, layer: nn.Module, parts: list[CheckpointSlice]) -> None:
        """Convert each slice with the format, stack them (Int4Weight.concat) and keep them on the device."""
        converted = []
        for name, tensors, size in parts:
            try:
                part = self.form.convert(tensors, layer.in_features, size, layer.dtype)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from err
            if not torch.isfinite(part.scales).all():  # else every completion fails later as "non-finite logits"
                raise ValueError(f"checkpoint tensor {name}.{self.form.scale_suffix} holds NaN or infinite scales "
                                 f"(in {layer.dtype}); the checkpoint is corrupt")
            if (part.out_features, part.in_features) != (size, layer.in_features):
                raise ValueError(f"checkpoint tensors of {name} convert to a [{part.out_features}, "
                                 f"{part.in_features}] weight, the model expects {[size, layer.in_features]}")
            converted.append(part)
        try:
            weight = Int4Weight.concat(converted)
        except ValueError as err:
            raise ValueError(f"{', '.join(name for name, _, _ in parts)}: {err}") from err
        weight.check()
        for field in ("qweight", "scales", "zeros", "g_idx"):
            value = getattr(weight, field)
            setattr(layer, field, None if value is None else value.to(layer.device))
        layer.group_size = weight.group_size

    def weight(self, layer: nn.Module) -> Int4Weight:
        """The layer's Int4Weight (views of its buffers)."""
        return Int4Weight(layer.qweight, layer.scales, layer.zeros, layer.g_idx, layer.group_size)

    def after_loading(self, layer: nn.Module) -> None:
        """Nothing: the weight stays packed as 4-bit words."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cuda:  # the Triton GEMM, dequantizing in the kernel
            return punica_kernels.w4a16_matmul(x, layer.qweight, layer.scales, layer.zeros, layer.g_idx,
                                               layer.group_size, bias)  # [T, N]
        return F.linear(x, self.weight(layer).dequantize(x.dtype), bias)  # [T, N]

    def dequantize(self, layer: nn.Module) -> torch.Tensor:
        return self.weight(layer).dequantize(layer.dtype)


UNQUANTIZED = UnquantizedLinear()
LinearMethod = UnquantizedLinear | Fp8Linear | Int4Linear


def linear_method(quant: QuantConfig | None) -> LinearMethod:
    """The method of every decoder linear under `quant` (None: unquantized)."""
    if quant is None:
        return UNQUANTIZED
    if quant.kind == "fp8":
        return Fp8Linear(quant.fp8)
    return Int4Linear(quant.int4)
