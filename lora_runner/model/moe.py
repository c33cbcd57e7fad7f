"""The sparse mixture-of-experts block of Mixtral, Qwen3-MoE and Qwen2-MoE, with LoRA on its router and experts.

Routing as transformers computes it: router logits x @ W_r.T in the model dtype, softmax in float32,
top-k experts per token, the k probabilities renormalised to sum 1 (Mixtral always; Qwen3-MoE with
``norm_topk_prob``), then cast to the model dtype (Qwen3-MoE; Mixtral keeps them float32 until the
weighted expert output is cast). The (token, k) pairs are sorted by expert once per block and each
projection (gate,up packed -> "gate_up"; down) is one grouped GEMM over them (lora_runner.model.moe_cpu,
the CPU's torch path), and the weighted outputs are summed per token in ascending expert order
(transformers' order). Qwen2-MoE adds a shared expert every token takes, weighted by
sigmoid(shared_expert_gate(x)). On CUDA the routed experts run through the fused Triton kernels
(:meth:`SparseMoeBlock.routed_experts`, lora_runner.model.moe_fused), which sync with no host and so run
in the decode graphs (the torch path's grouping reads the routing on the host: it refuses to run under
capture); the batch-invariant mode keeps a loop over the experts hit (:class:`Expert`, its GEMMs in
fixed row blocks). The experts' weights are allocated as entries of one buffer per projection
(``gate_up`` [E, 2I, H], ``down`` [E, H, I]), left dense after loading (:class:`StackedDenseLinear`),
that the grouped GEMM and the kernels read as they are. With ``quantization="fp8"`` (or a compressed-tensors
FP8 checkpoint) those buffers are float8_e4m3fn with float32 scales per (expert, output row) beside them
(lora_runner.model.moe_fp8); the router and the shared expert's gate stay unquantized, the shared expert is a
dense FP8 linear.

Every projection is a :class:`LoRALinear` of its own, built from the descriptors
lora_runner.model.lora_linear.moe_lora_modules declares (one per expert per projection, PEFT /
checkpoint names per expert), so the loader, the adapter code and the slots need nothing MoE-specific.
The router's LoRA runs over every token as any linear's (punica_kernels.add_lora); an expert's
LoRA delta runs over the tokens routed to it (grouped by (expert, slot): moe_cpu.add_grouped_lora; in
the loop :func:`add_expert_lora`) before the activation (gate_up) or the routing weight (down), as
PEFT's per-expert modules do; tokens whose adapter has no expert LoRA (``LoRASlots.expert_ranks`` 0:
attention only) skip it. Checkpoints in transformers 5's fused
layout (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) are read through
:func:`split_fused_experts`.

Tensor parallelism (adapters.sharding): each expert splits over the ranks along its intermediate rows
as a dense MLP does (gate_up column-parallel, down row-parallel), the shared expert too; the router
and the shared expert's gate are replicated, so every rank routes every token alike. The experts'
partial outputs are summed over the ranks by one all-reduce after the block; their LoRA follows
the split (B of gate_up by rows, A of down by columns), so it adds no collective.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from adapters.spec import LoRAModule
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model import moe_cpu, moe_fp8, moe_fused
from lora_runner.model.forward_context import ForwardContext, LoRAContext
from lora_runner.model.lora_linear import LoRALinear, moe_lora_modules
from lora_runner.model.quant.linear import UNQUANTIZED, LinearMethod, UnquantizedLinear
from punica_kernels import invariant

_FUSED_KEY = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(experts\.gate_up_proj|experts\.down_proj"
                        r"|gate\.weight)")


class Expert(nn.Module):
    """One SwiGLU expert: down(silu(gate(x)) * up(x)), gate and up packed into ``gate_up``."""

    def __init__(self, gate_up: LoRALinear, down: LoRALinear):
        super().__init__()
        self.gate_up, self.down = gate_up, down

    def forward(self, x: torch.Tensor, token_slots: torch.Tensor | None, lora: LoRAContext | None) -> torch.Tensor:
        """x [M, hidden] (the tokens routed here), token_slots [M] their adapter slots (None: no LoRA)."""
        gate_up = self.gate_up(x, None)  # [M, 2I]
        if token_slots is not None:
            add_expert_lora(gate_up, x, token_slots, lora, self.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [M, I] each
        hidden = F.silu(gate) * up  # [M, I]
        out = self.down(hidden, None)  # [M, hidden]
        if token_slots is not None:
            add_expert_lora(out, hidden, token_slots, lora, self.down)
        return out

    def forward_all(self, x: torch.Tensor, lora: LoRAContext | None) -> torch.Tensor:
        """The expert over every token x [T, hidden] (a shared expert), each token's LoRA through its linears."""
        gate, up = self.gate_up(x, lora).chunk(2, dim=-1)  # [T, I] each
        return self.down(F.silu(gate) * up, lora)  # [T, hidden]


class SparseMoeBlock(nn.Module):
    """Router + ``num_experts`` experts of one layer; ``forward(hidden [T, H], ctx) -> [T, H]``."""

    def __init__(self, config, layer: int, dtype: torch.dtype, device, tp: TensorParallel = SINGLE):
        super().__init__()
        router, *projections = moe_lora_modules(config, layer)
        projections, shared = projections[:2 * config.num_experts], projections[2 * config.num_experts:]
        self.router = LoRALinear(router, False, dtype, device)  # replicated, never quantized: every rank routes alike
        method = moe_fp8.expert_method(config.quantization, tp) or STACKED_DENSE
        self.experts = _stacked_experts(projections, dtype, device, tp, method)
        self.shared_expert = self.shared_expert_gate = None
        if shared:  # Qwen2-MoE: + sigmoid(shared_expert_gate(x)) * shared_expert(x)
            gate_up, down, gate = shared
            shared_method = moe_fp8.shared_expert_method(config.quantization, tp)
            self.shared_expert = _expert(gate_up, down, dtype, device, tp, shared_method)
            self.shared_expert_gate = LoRALinear(gate, False, dtype, device)  # replicated: a per-token scalar
        # over several ranks every expert's down (and the shared one's) gives a partial sum; the weighted
        # sum of them is linear in each, so ONE all-reduce after the block sums them all (none for LoRA)
        self.reduce = tp if tp.is_parallel else None
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.weights_in_float = config.router_weights_in_float

    def route(self, hidden: torch.Tensor, lora: LoRAContext | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k], expert ids [T, k]) as transformers' router computes them."""
        logits = self.router(hidden, lora)  # [T, E], model dtype
        if invariant.enabled() and invariant.uses_triton(logits):  # per-row kernels, the lowest expert on ties
            probs = invariant.softmax(logits.float())  # [T, E]
            weights, experts = invariant.topk(probs, self.top_k)  # [T, k] each
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
            weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k] each
        if self.renormalize:
            # the batch-invariant mode adds the k weights column by column: torch's row sum on CUDA picks its
            # threads per row from T (punica_kernels.invariant_triton)
            total = sum(weights.unbind(-1))[:, None] if invariant.enabled() else weights.sum(dim=-1, keepdim=True)
            weights = weights / total
        return (weights if self.weights_in_float else weights.to(logits.dtype)), experts

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        weights, experts = self.route(hidden, ctx.lora)  # [T, k] each
        out = self.routed_experts(hidden, weights, experts, ctx.lora)  # [T, H]
        if self.shared_expert is not None:  # every token, its LoRA as any linear's
            shared = self.shared_expert.forward_all(hidden, ctx.lora)  # [T, H]
            out = out + torch.sigmoid(self.shared_expert_gate(hidden, ctx.lora)) * shared
        if self.reduce is not None:
            self.reduce.all_reduce(out)  # [T, H]: the sum of every rank's partial expert outputs
        return out

    def routed_experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                       lora: LoRAContext | None) -> torch.Tensor:
        """sum_j weights[t, j] * expert_{experts[t, j]}(hidden[t]) [T, H], each with the token's expert LoRA:
        the fused Triton kernels on CUDA (lora_runner.model.moe_fused), else torch's grouped GEMMs over the
        pairs sorted by expert (lora_runner.model.moe_cpu), or in the batch-invariant mode a loop over the
        experts hit (each GEMM in fixed row blocks: punica_kernels.invariant)."""
        # the fused kernels' tiles follow the expert groups' sizes: the batch-invariant mode takes the loop,
        # whose GEMMs and LoRA are the mode's row-invariant ones
        if moe_fused.use_fused(self, hidden) and not invariant.enabled():
            return moe_fused.fused_routed_experts(self, hidden, weights, experts, lora)
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():  # the grouping below reads experts on the host
            raise RuntimeError("this mixture-of-experts layer runs the torch loop (the batch-invariant mode, or "
                               "experts the fused kernels cannot take), which cannot run in CUDA graphs: serve this "
                               "model with enforce_eager=True")
        slots = None if lora is None else expert_token_slots(lora, hidden.shape[0])  # [T] or None
        if not invariant.enabled():
            return moe_cpu.routed_experts(self, hidden, weights, experts, slots, lora)
        out = torch.zeros_like(hidden)  # [T, H]
        for expert in experts.unique().tolist():  # ascending: each token sums its experts in transformers' order
            token_idx, k_pos = torch.where(experts == expert)  # [M] each
            y = self.experts[expert](hidden[token_idx], None if slots is None else slots[token_idx], lora)
            out.index_add_(0, token_idx, (y * weights[token_idx, k_pos, None]).to(out.dtype))
        return out


def expert_token_slots(lora: LoRAContext, num_tokens: int) -> torch.Tensor | None:
    """Each token's adapter slot [T] where that slot holds expert LoRA (``LoRASlots.expert_ranks`` > 0),
    else -1; None when no token's does (the torch loop then runs no expert LoRA at all). Reads the
    device on the host: the torch path's."""
    token_slots, ranks = lora.meta.token_slots[:num_tokens], lora.slots.expert_ranks  # [T], [L]
    if ranks.shape[0] == 0:
        return None
    slots = torch.where((token_slots >= 0) & (ranks[token_slots.clamp(0, ranks.shape[0] - 1)] > 0), token_slots, -1)
    return slots if bool((slots >= 0).any()) else None


def _stacked_experts(projections: tuple[LoRAModule, ...], dtype: torch.dtype, device,
                     tp: TensorParallel, method: LinearMethod) -> nn.ModuleList:
    """The routed experts of (gate_up, down) descriptor pairs, their weights entries e of one buffer per
    projection and tensor (gate_up [E, 2I, H], down [E, H, I] at ``tp``'s share; FP8 adds the scales
    [E, 2I], [E, H]: moe_fp8) that the fused kernels read with no copy (moe_fused.stack_in_place); each
    expert's own tensors are dropped as soon as it is built, so at most one expert's is allocated beside
    the buffers."""
    experts, stacks = nn.ModuleList(), None
    names = moe_fp8.stacked_tensor_names(method)
    for e, (gate_up, down) in enumerate(zip(projections[0::2], projections[1::2])):
        expert = _expert(gate_up, down, dtype, device, tp, method)
        tensors = [(linear, name) for linear in (expert.gate_up, expert.down) for name in names]
        if stacks is None:
            stacks = [torch.empty(len(projections) // 2, *getattr(linear, name).shape,
                                  dtype=getattr(linear, name).dtype, device=device) for linear, name in tensors]
        for (linear, name), stack in zip(tensors, stacks):
            getattr(linear, name).data = stack[e]  # the parameter (buffer) stays; loading writes into the stack
        experts.append(expert)
    return experts


class StackedDenseLinear(UnquantizedLinear):
    """A routed expert's unquantized weight, left dense after loading (no oneDNN packing: cpu_gemm): it is
    an entry of its block's stacked buffer, which the grouped GEMM (lora_runner.model.moe_cpu) and the
    fused kernels read as it is (measured, benchmarks/bench_moe.py: faster than packed experts in decode
    and prefill)."""

    def after_loading(self, layer: nn.Module) -> None:
        pass


STACKED_DENSE = StackedDenseLinear()


def _expert(gate_up: LoRAModule, down: LoRAModule, dtype: torch.dtype, device, tp: TensorParallel,
            method: LinearMethod = UNQUANTIZED) -> Expert:
    """An expert at ``tp``'s share: gate_up column-parallel, down row-parallel and left unreduced (the
    block reduces once for all its experts)."""
    return Expert(LoRALinear(gate_up, False, dtype, device, method=method, tp=tp),
                  LoRALinear(down, False, dtype, device, method=method, tp=tp, reduce=False))


def add_expert_lora(y: torch.Tensor, x: torch.Tensor, token_slots: torch.Tensor, lora: LoRAContext,
                    linear: LoRALinear) -> torch.Tensor:
    """Add each row's adapter delta to an expert projection's output, in place.

    Semantics: y[i, off_j:off_j+N_j] += slice_scales[s, j] * (x[i] @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T
    for s = token_slots[i] >= 0, with ``linear``'s slots (lora_a [max_loras, n, R, K], lora_b
    [max_loras, N, R]); rows of slot -1 stay as they are. x [M, K], y [M, N] the rows routed to this
    expert; computed in float32 for half dtypes (as punica_kernels.add_lora)."""
    lora_a, lora_b = lora.slots.weights(linear.layer, linear.name)
    slice_scales, _ = lora.slots.scales(linear.layer, linear.name)  # [max_loras, n]; experts have no DoRA
    compute = torch.float32 if y.dtype in (torch.float16, torch.bfloat16) else y.dtype
    for slot in token_slots.unique().tolist():
        if slot < 0:
            continue
        rows = (token_slots == slot).nonzero().squeeze(1)  # [m]
        x_rows = x[rows].to(compute)  # [m, K]
        for j, (offset, size) in enumerate(zip(linear.slice_offsets(), linear.slice_sizes)):
            # invariant.matmul: row blocks of a fixed shape in the batch-invariant mode, one matmul otherwise
            inter = invariant.matmul(x_rows, lora_a[slot, j].to(compute)) * slice_scales[slot, j].to(compute)  # [m, R]
            delta = invariant.matmul(inter, lora_b[slot, offset:offset + size].to(compute))  # [m, N_j]
            # added in the compute dtype and rounded once, as the dense linears' LoRA (punica_kernels.add_lora)
            y[rows, offset:offset + size] = (y[rows, offset:offset + size].to(compute) + delta).to(y.dtype)
    return y


def match_fused_experts(name: str, config) -> tuple[int, str] | None:
    """(layer, "experts.gate_up_proj" | "experts.down_proj" | "gate.weight") of a checkpoint tensor in
    transformers 5's fused expert layout of an MoE layer, else None."""
    match = _FUSED_KEY.fullmatch(name)
    if match is None or int(match.group(1)) not in config.moe_layers:
        return None
    return int(match.group(1)), match.group(2)


def split_fused_experts(weights: Iterable[tuple[str, torch.Tensor]], config) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with transformers 5's fused expert tensors of each MoE layer (``experts.gate_up_proj``
    [E, 2I, H]: gate rows then up rows; ``experts.down_proj`` [E, H, I]; the router as ``mlp.gate``) renamed
    and split into the per-expert tensors the layers declare (moe_lora_modules); other tensors pass through."""
    for name, tensor in weights:
        match = match_fused_experts(name, config)
        if match is None:
            yield name, tensor
            continue
        layer, what = match
        router, *projections = moe_lora_modules(config, layer)
        projections = projections[:2 * config.num_experts]  # the routed experts' (not the shared expert's)
        if what == "gate.weight":
            yield f"{router.peft_modules[0][0]}.weight", tensor
            continue
        fused_gate_up = what == "experts.gate_up_proj"
        modules = projections[0::2] if fused_gate_up else projections[1::2]
        if tensor.shape[0] != len(modules):
            raise ValueError(f"checkpoint tensor {name!r} holds {tensor.shape[0]} experts, config.json says "
                             f"{len(modules)}")
        for module, expert_weight in zip(modules, tensor):
            # gate and up are equally wide: halves of the whole rows, or of a rank's share of each (tp_shards)
            rows = expert_weight.chunk(len(module.slice_sizes)) if fused_gate_up else (expert_weight,)
            for (path, _), part in zip(module.peft_modules, rows):
                yield f"{path}.weight", part
