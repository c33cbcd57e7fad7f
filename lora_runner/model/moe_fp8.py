"""FP8 for a mixture-of-experts block's routed experts: quantized at load (``quantization="fp8"`` on a float
checkpoint) or read from a compressed-tensors FP8 checkpoint.

Online, each routed expert's gate_up and down are quantized as a dense FP8 linear's are
(lora_runner.model.quant.fp8: float8_e4m3fn weight, float32 scale per output channel, max|W[n]| / 448).
A compressed-tensors checkpoint (llm-compressor's FP8 / FP8_DYNAMIC on Qwen3-30B-A3B, Mixtral, ...) holds
every expert's projections as Linears of their own (``experts.<e>.gate_proj.weight`` float8_e4m3fn and
``weight_scale``, per output channel [N, 1] or per tensor [1], the latter broadcast to the rows of its
slice, as the dense path does: Fp8Format.convert), the router and Qwen2-MoE's shared expert gate left
float through its ``ignore`` list (QuantConfig.check_ignore). Either way they are held as entries of one
buffer per projection and tensor, as the unquantized experts are (lora_runner.model.moe)::

    gate_up.weight [E, 2I, H] float8_e4m3fn   gate_up.weight_scale [E, 2I] float32
    down.weight    [E, H, I]  float8_e4m3fn   down.weight_scale    [E, H]  float32

W_e = weight[e].float() * weight_scale[e][:, None]. The weights stay FP8 in memory: the CPU's grouped
GEMM dequantizes the experts a batch routes to (:func:`dequantize_experts`), the fused Triton GEMM
converts each FP8 tile to the activations' dtype and scales its accumulator per output channel
(punica_kernels.moe_triton). Weight-only on every device: the activations stay in the model dtype (the
dense FP8 linears quantize theirs on CUDA; the experts' grouped GEMM does not, as vLLM's online FP8
MoE on GPUs without FP8 tensor cores; a compressed-tensors FP8_DYNAMIC checkpoint's experts too, where
vLLM quantizes their activations per token). The router and Qwen2-MoE's shared expert gate stay unquantized;
the shared expert is a dense FP8 linear.

Tensor parallelism: gate_up is column-parallel, so its rows and their scales split alike; down is
row-parallel and its partial sums are reduced by the block, not by the linear, so online the row maximum
over every rank's columns is taken here (``row_max``, one all-reduce per expert at load; the shared
expert's down alike: :class:`UnreducedFp8Linear`): each rank then quantizes its columns with the scale
one rank would use. A checkpoint's scales are already the whole rows': each rank reads them whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adapters.spec import ROW
from lora_runner.distributed import TensorParallel
from lora_runner.model.quant import fp8
from lora_runner.model.quant.config import QuantConfig
from lora_runner.model.quant.fp8 import Fp8Format
from lora_runner.model.quant.linear import UNQUANTIZED, Fp8Linear, LinearMethod


# an MoE block's LoRA modules whose base weight stays in the model dtype under any quantization (they
# route: a per-token scalar or E logits, a negligible share of the weights)
FLOAT_MODULES = ("router", "shared_expert_gate")


class UnreducedFp8Linear(Fp8Linear):
    """An FP8 linear of an MoE block (an expert's, or the shared expert's) whose row-parallel shard is left
    unreduced (the block reduces once): its scales are still taken over the whole row, from ``tp``."""

    def __init__(self, form: Fp8Format, tp: TensorParallel):
        super().__init__(form)
        self.tp = tp

    def row_max(self, layer: nn.Module) -> fp8.RowMax | None:
        """A row-parallel shard's row maxima over every rank, by ``tp`` (the layer itself never reduces)."""
        if layer.lora_module.parallel == ROW and self.tp.is_parallel:
            return lambda amax: self.tp.all_reduce(amax, op="max")
        return None


class StackedFp8Linear(UnreducedFp8Linear):
    """A routed expert's FP8 weight (buffers ``weight`` [N, K] float8_e4m3fn, ``weight_scale`` [N]
    float32, entries of the block's stacked buffers): weight-only on every device."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # weight-only, as the grouped paths (moe_cpu, the fused kernels): an expert called on its own (the
        # per-expert loops; the batch-invariant mode refuses quantized models) computes what they do
        return F.linear(x, fp8.dequantize(layer.weight, layer.weight_scale, x.dtype), bias)  # [T, N]


def expert_method(quant: QuantConfig | None, tp: TensorParallel) -> StackedFp8Linear | None:
    """The routed experts' linear method under ``quant``: StackedFp8Linear for FP8 (quantized online, or read
    from a compressed-tensors checkpoint), None for unquantized experts (any other quantization is refused
    by ModelConfig first)."""
    assert quant is None or quant.kind == "fp8", f"not an MoE quantization: {quant}"
    return None if quant is None else StackedFp8Linear(quant.fp8, tp)


def shared_expert_method(quant: QuantConfig | None, tp: TensorParallel) -> LinearMethod:
    """The shared expert's linear method: a dense FP8 linear (activations quantized on CUDA, as the
    attention's) with its unreduced down's scales over the whole row, or unquantized."""
    return UNQUANTIZED if quant is None else UnreducedFp8Linear(quant.fp8, tp)


def stacked_tensor_names(method) -> tuple[str, ...]:
    """The per-expert tensors a method holds that the block stacks into one buffer each."""
    return ("weight", "weight_scale") if isinstance(method, StackedFp8Linear) else ("weight",)


def dequantize_experts(weight: torch.Tensor, weight_scale: torch.Tensor, sizes: list[int],
                       dtype: torch.dtype) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The experts a batch routes to, dequantized: (W [G, N, K] in ``dtype``, their group sizes [G],
    int32 cumulative ends [G]) for weight [E, N, K] FP8, weight_scale [E, N] and rows per expert
    ``sizes`` [E]; G the experts with rows, so a decode step dequantizes k experts per token at most."""
    present = [e for e, size in enumerate(sizes) if size]
    index = torch.tensor(present, dtype=torch.int64, device=weight.device)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    dense = (weight[index].to(compute) * weight_scale[index].to(compute)[:, :, None]).to(dtype)  # [G, N, K]
    kept = [sizes[e] for e in present]
    return dense, kept, torch.cumsum(torch.tensor(kept), 0).to(torch.int32)
