"""The LoRA-aware linear and the LoRA modules it declares: the model owns its LoRA layout.

Each LoRA-capable module is built from its descriptor (adapters.spec.LoRAModule): the PEFT module
paths it answers to and the slices each covers, its slice output sizes and input size, and its
tensor-parallel split (column-parallel: output rows, with B's rows and DoRA's column scale;
row-parallel: input columns, with A's columns, outputs all-reduced). The adapter code reads the same
descriptors (ModelSpec.modules), collected here from a model (:func:`collect_spec`) or, for a
process that holds no model (the engine at tp > 1, the start-up check), computed from the config by
the function the decoder layers build their linears with (:func:`decoder_lora_modules`): this module
imports no ModelConfig, so ``ModelConfig.spec()`` can call it without an import cycle.

A Llama-family decoder layer packs projections sharing an input: q,k,v -> "qkv" (3 slices),
gate,up -> "gate_up" (2); o and down are single-slice. Phi-3 checkpoints and adapters name the packed
modules themselves (``qkv_proj``, ``gate_up_proj``): one PEFT module covers every slice. A module's
PEFT paths are also its checkpoint tensor prefixes (``<path>.weight``), read by the model loader and
by :func:`checkpoint_base_weights`' DoRA reader.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import nn

import punica_kernels
from adapters.dora import BaseWeight
from adapters.spec import COLUMN, ROW, LoRAModule, ModelSpec, Split
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.quant.linear import UNQUANTIZED, LinearMethod


class LoRALinear(nn.Module):
    """y = x @ W.T (+ b), plus each token's adapter delta through punica_kernels.add_lora.

    Built from its full-model descriptor ``lora_module`` (kept, for collection and checkpoint
    reading) at ``tp``'s share of it. Several projections sharing an input are packed into one
    weight; ``slice_sizes`` are this rank's output widths, in the order the LoRA slots store them.
    The slots' scales ride along: LoRA scaling per slice, and DoRA's column scale, which multiplies
    the output of that slot's tokens but not the bias (as PEFT).

    The base matmul x @ W.T (+ b) is the ``method``'s (unquantized, FP8 or W4A16:
    lora_runner.model.quant.linear), which also holds the weight's tensors.

    Row-parallel over several ranks: this rank holds the input columns of its shard, so base and
    LoRA (A's columns split, B whole) give partial sums, DoRA's column scale applied to each (exact:
    it is linear per output column); ONE ``all_reduce`` sums them and the bias is added once, after it
    (``reduce=False``: the partial sum is returned; its owner reduces, as the MoE block does once
    for all its experts).
    """

    def __init__(self, lora_module: LoRAModule, bias: bool, dtype: torch.dtype, device,
                 method: LinearMethod = UNQUANTIZED, tp: TensorParallel = SINGLE, reduce: bool = True):
        super().__init__()
        self.lora_module = lora_module  # the whole model's descriptor (ModelSpec.modules)
        local = lora_module.shard(tp.rank, tp.world_size)
        # reduce=False: a row-parallel linear whose owner sums partial outputs of several linears in one
        # all-reduce (the MoE block's experts); it then returns this rank's partial sum, with no bias
        assert reduce or not bias, "a row-parallel linear left unreduced cannot add its bias once"
        self.reduce = tp if lora_module.parallel == ROW and tp.is_parallel and reduce else None
        self.method = method  # holds and multiplies by the base weight (lora_runner.model.quant.linear)
        self.in_features, self.out_features = local.in_features, local.out_features
        self.dtype, self.device = dtype, torch.device(device)
        method.create_weights(self, self.in_features, self.out_features, dtype, device)
        self.bias = (nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)  # [N]
        self.slice_sizes = local.slice_sizes
        self.layer, self.name = lora_module.key

    def forward(self, x: torch.Tensor, lora: LoRAContext | None) -> torch.Tensor:
        # row-parallel: the bias joins after the reduction, so it is out of the partial sums (and DoRA's scale)
        bias = self.bias if self.reduce is None else None
        y = self.method.apply(self, x, bias)  # [T, N]
        if lora is not None:
            lora_a, lora_b = lora.slots.weights(self.layer, self.name)
            slice_scales, column_scales = lora.slots.scales(self.layer, self.name)
            if not lora.features.dora:  # the step's adapters all have column scale 1: y + delta exactly
                column_scales = None
            punica_kernels.add_lora(y, x, lora_a, lora_b, lora.meta, self.slice_sizes, slice_scales=slice_scales,
                                    column_scales=column_scales, bias=bias)
        if self.reduce is None:
            return y
        self.reduce.all_reduce(y)  # [T, N]: the sum of every rank's partial output
        return y if self.bias is None else y.add_(self.bias)

    def base_weight(self) -> torch.Tensor:
        """The base weight W [N, K] in the model dtype (dequantized, a new tensor, for a quantized layer)."""
        return self.method.dequantize(self)

    def slice_offsets(self) -> tuple[int, ...]:
        """Row offset of each slice within the packed weight."""
        return tuple(sum(self.slice_sizes[:i]) for i in range(len(self.slice_sizes)))

    def checkpoint_slices(self) -> list[tuple[str, int | None]]:
        """(checkpoint tensor prefix, slice index or None) of each tensor group holding this module's
        weight: one per slice, or one for a fused module covering them all (index None)."""
        return [(path, indices[0] if len(self.slice_sizes) > 1 and len(indices) == 1 else None)
                for path, indices in self.lora_module.peft_modules]

    def load_checkpoint(self, read: Callable[[str], torch.Tensor | None]) -> None:
        """Fill the base weight from checkpoint tensors (``read(name)``; None for an absent optional one),
        as the model loader does: a quantized one through its method, slice by slice."""
        parts = []
        for prefix, index in self.checkpoint_slices():
            suffixes = (*self.method.suffixes, *getattr(self.method, "optional_suffixes", ()))
            tensors = {suffix: t for suffix in suffixes if (t := read(f"{prefix}.{suffix}")) is not None}
            parts.append((prefix, tensors, self.out_features if index is None else self.slice_sizes[index]))
        if self.method.quantized:
            self.method.load(self, parts)
        else:
            self.weight.copy_(torch.cat([tensors["weight"] for _, tensors, _ in parts]))  # [N, K]


def attention_lora_modules(config, layer: int) -> tuple[LoRAModule, LoRAModule]:
    """(qkv, o) of one decoder layer: q,k,v packed and column-parallel by heads (KV heads replicated
    when there are fewer than ranks), o row-parallel by the same heads. ``config``: a ModelConfig."""
    heads = Split(config.num_heads, config.head_dim, "num_attention_heads")
    kv_heads = Split(config.num_kv_heads, config.head_dim, "num_key_value_heads", replicate=True)
    prefix = f"model.layers.{layer}.self_attn"
    qkv = LoRAModule(layer, "qkv", config.hidden_size, (heads.size, kv_heads.size, kv_heads.size),
                     _packed_names(config, prefix, "qkv_proj", ("q_proj", "k_proj", "v_proj")), COLUMN,
                     out_splits=(heads, kv_heads, kv_heads))
    o = LoRAModule(layer, "o", heads.size, (config.hidden_size,), ((f"{prefix}.o_proj", (0,)),), ROW, in_split=heads)
    return qkv, o


def mlp_lora_modules(config, layer: int, parent: str = "mlp", size: int | None = None,
                     name: str = "") -> tuple[LoRAModule, LoRAModule]:
    """(gate_up, down) of one decoder layer: gate,up packed and column-parallel by intermediate rows,
    down row-parallel by the same rows. ``config``: a ModelConfig. A gated MLP elsewhere in the layer
    (Qwen2-MoE's shared expert) passes its ``parent`` module path, intermediate ``size`` and a ``name``
    prefix for its slot keys ("shared_expert." -> "shared_expert.gate_up")."""
    rows = Split(size or config.intermediate_size, 1, "intermediate_size")
    prefix = f"model.layers.{layer}.{parent}"
    gate_up = LoRAModule(layer, f"{name}gate_up", config.hidden_size, (rows.size, rows.size),
                         _packed_names(config, prefix, "gate_up_proj", ("gate_proj", "up_proj")), COLUMN,
                         out_splits=(rows, rows))
    down = LoRAModule(layer, f"{name}down", rows.size, (config.hidden_size,), ((f"{prefix}.down_proj", (0,)),), ROW,
                      in_split=rows)
    return gate_up, down


def _packed_names(config, prefix: str, fused: str, leaves: tuple[str, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The PEFT / checkpoint modules of a packed linear: one per slice, or Phi-3's one fused module."""
    if config.fused_projections:
        return ((f"{prefix}.{fused}", tuple(range(len(leaves)))),)
    return tuple((f"{prefix}.{leaf}", (j,)) for j, leaf in enumerate(leaves))


# checkpoint / PEFT names of a sparse-MoE block: (parent, gate (slice 0 of gate_up), up (slice 1), down)
_MOE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
              "qwen_moe": ("mlp", "gate_proj", "up_proj", "down_proj")}


def moe_lora_modules(config, layer: int) -> tuple[LoRAModule, ...]:
    """(router, then per expert e: gate_up, down, then Qwen2-MoE's shared expert: gate_up, down and its
    sigmoid gate) of one sparse-MoE layer (lora_runner.model.moe), one module per expert per projection,
    named "router", "experts.<e>.gate_up", "experts.<e>.down", "shared_expert.gate_up",
    "shared_expert.down", "shared_expert_gate"; PEFT /
    checkpoint paths as Hub checkpoints name them per expert (Mixtral ``block_sparse_moe.experts.<e>.w1``
    (gate) / ``w3`` (up) / ``w2`` (down) and ``block_sparse_moe.gate``; Qwen3-MoE ``mlp.experts.<e>.
    gate_proj`` / ``up_proj`` / ``down_proj`` and ``mlp.gate``). Over tensor-parallel ranks each expert
    splits as a dense MLP (gate_up column-parallel, down row-parallel, by ``moe_intermediate_size`` rows;
    the shared expert likewise by its own size), the router and the shared expert's gate are
    replicated; the experts apply plain LoRA only (``dora=False``). Each expert module is also
    entry e of transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``, which PEFT's
    ``target_parameters`` adapters target (``stacked``, adapters.stacked)."""
    parent, gate, up, down = _MOE_NAMES[config.moe_naming]
    prefix, hidden, rows = f"model.layers.{layer}.{parent}", config.hidden_size, config.moe_intermediate_size
    modules = [LoRAModule(layer, "router", hidden, (config.num_experts,), ((f"{prefix}.gate", (0,)),))]
    stacked, count = f"model.layers.{layer}.mlp.experts", config.num_experts  # transformers 5's fused parameters
    split = Split(rows, 1, "moe_intermediate_size")  # each expert split as a dense MLP: intermediate rows
    for e in range(count):
        expert = f"{prefix}.experts.{e}"
        modules.append(LoRAModule(layer, f"experts.{e}.gate_up", hidden, (rows, rows),
                                  ((f"{expert}.{gate}", (0,)), (f"{expert}.{up}", (1,))), COLUMN,
                                  out_splits=(split, split), dora=False, stacked=(f"{stacked}.gate_up_proj", e, count)))
        modules.append(LoRAModule(layer, f"experts.{e}.down", rows, (hidden,), ((f"{expert}.{down}", (0,)),), ROW,
                                  in_split=split, dora=False, stacked=(f"{stacked}.down_proj", e, count)))
    if getattr(config, "shared_expert_intermediate_size", None):  # Qwen2-MoE: a dense expert every token takes
        modules.extend(mlp_lora_modules(config, layer, "mlp.shared_expert", config.shared_expert_intermediate_size,
                                        "shared_expert."))
        modules.append(LoRAModule(layer, "shared_expert_gate", hidden, (1,), ((f"{prefix}.shared_expert_gate", (0,)),)))
    return tuple(modules)


def decoder_lora_modules(config) -> tuple[LoRAModule, ...]:
    """Every LoRA-capable module of a Llama-family decoder of ``config`` (a ModelConfig), as its
    layers build them: per layer qkv, o, then gate_up, down (a sparse-MoE layer: :func:`moe_lora_modules`)."""
    moe_layers = set(getattr(config, "moe_layers", ()))
    return tuple(module for layer in range(config.num_layers)
                 for module in (*attention_lora_modules(config, layer),
                                *(moe_lora_modules(config, layer) if layer in moe_layers
                                  else mlp_lora_modules(config, layer))))


def collect_spec(model: nn.Module, spec: ModelSpec) -> ModelSpec:
    """``spec`` with the LoRA modules ``model``'s layers declare (every module with a ``lora_module``),
    in module order: what an adapter of this model may target and how its slots are shaped."""
    return replace(spec, modules=tuple(m.lora_module for m in model.modules() if hasattr(m, "lora_module")))


def base_weight_reader(linear: Callable[[int, str], LoRALinear]) -> BaseWeight:
    """DoRA's base weights (adapters.dora, adapters.lora's ``base_weight``): (layer, name) -> W [N, K]
    of the whole linear ``linear(layer, name)`` gives, dequantized when quantized. The last one is
    kept, so the slices of one packed weight (q, k, v) read and dequantize it once per adapter load.
    The one reader, over two sources: the served model (:func:`lora_base_weights`) and, in a process
    without the whole model, the checkpoint (lora_runner.model.checkpoint_base_weights)."""
    last: dict[tuple[int, str], torch.Tensor] = {}

    def base_weight(layer: int, name: str) -> torch.Tensor:
        key = (layer, name)
        if key not in last:
            last.clear()
            last[key] = linear(layer, name).base_weight()  # [N, K]
        return last[key]

    return base_weight


def lora_base_weights(model: nn.Module) -> BaseWeight:
    """DoRA's base weights read from the served ``model`` (:func:`base_weight_reader`).

    A tensor-parallel shard holds no row-parallel layer's whole rows: ValueError (DoRA's scales then
    come from lora_runner.model.checkpoint_base_weights, in the process that validates the adapter)."""
    tp = getattr(model, "tp", None)
    if tp is not None and tp.is_parallel:
        raise ValueError("lora_base_weights needs the whole model; a tensor-parallel rank holds a shard of it: "
                         "read DoRA's base weights with lora_runner.model.checkpoint_base_weights")
    linears = {m.lora_module.key: m for m in model.modules() if isinstance(m, LoRALinear)}
    return base_weight_reader(lambda layer, name: linears[(layer, name)])
