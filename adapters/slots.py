"""Device slots: persistent tensors the kernels read, allocated once at their maximum size.

LoRA layout (design.md section 3), per LoRA-capable module (adapters.spec.LoRAModule: one layer's
packed q,k,v, say; :class:`ModuleSlots`) with slices j of widths N_j at offsets off_j, for slot s
holding an adapter whose slice j has rank r_j:
``lora_a[s, j, :r_j, :] = A_j`` and ``lora_b[s, off_j:off_j+N_j, :r_j] = B_j``; everything
else of the slot is zero (untargeted modules, ranks above r_j), so zero-padding to R costs nothing
in the result. Beside them, float32 scales the expand applies (punica_kernels.scales):
``slice_scales[s, j] = scaling_j`` (on the fp32 intermediate, never folded into a half B) and
``column_scales[s, off_j:off_j+N_j]`` = DoRA's column scale, 1 for plain LoRA and empty slots
(a module that applies plain LoRA only, ``LoRAModule.dora`` False: a mixture's experts, has none).
On the CPU lora_b is a transposed view (its N columns contiguous, see :func:`zeros_b`).
Writing an adapter first resets the slot's whole range, so nothing of a previous tenant (a
larger rank, a DoRA scale) survives; clearing a slot resets its column scales to 1. Tensors are
only ever written in place (CUDA-graph safe).

Modules that are entries of one stacked parameter (``LoRAModule.stacked``: expert e of a layer's
``mlp.experts.gate_up_proj``) get views of one buffer per parameter, entry-major
(``lora_a [E, max_loras, n, R, K]``, ``lora_b [E, max_loras, N, R]``, ``slice_scales [E, max_loras, n]``),
so the fused MoE kernels read every expert's slots as one tensor with no copy
(lora_runner.model.moe_fused). ``expert_ranks`` marks which slots hold any such LoRA: an adapter on
attention alone runs no expert LoRA op.
"""

from __future__ import annotations

import numpy as np
import torch

from adapters.lora import LoRAWeights
from adapters.prompt import PromptWeights
from adapters.spec import LoRAModule, ModelSpec


def zeros_b(*shape: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed B-factor buffer ``[..., N, R]``. On the CPU its storage is ``[..., R, N]`` and this
    is its transposed view: the torch path's expand multiplies by B.T, and a batched matmul reads
    that 1.5-2x faster with N contiguous (measured, rank 16, 768-4096 columns, one thread). The
    Triton kernels take contiguous B (16-byte rows of R), so on CUDA it is contiguous."""
    if torch.device(device).type != "cpu":
        return torch.zeros(*shape, dtype=dtype, device=device)
    *batch, out_features, rank = shape
    return torch.zeros(*batch, rank, out_features, dtype=dtype, device=device).transpose(-1, -2)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    # Pinned CPU sources (the CPU cache pins memory when a GPU exists) copy asynchronously.
    dst.copy_(src, non_blocking=dst.is_cuda and src.is_pinned())


def slot_buffers(module: LoRAModule, entries: int, max_loras: int, max_lora_rank: int, device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed (lora_a [entries, max_loras, n, R, K], lora_b [entries, max_loras, N, R], slice_scales
    [entries, max_loras, n] float32) for ``entries`` modules of ``module``'s shape; lora_b as :func:`zeros_b`."""
    n = len(module.slice_sizes)
    lora_a = torch.zeros(entries, max_loras, n, max_lora_rank, module.in_features, dtype=dtype, device=device)
    lora_b = zeros_b(entries, max_loras, module.out_features, max_lora_rank, dtype=dtype, device=device)
    slice_scales = torch.zeros(entries, max_loras, n, dtype=torch.float32, device=device)
    return lora_a, lora_b, slice_scales


class ModuleSlots:
    """The slot tensors of one LoRA-capable module (its descriptor: adapters.spec.LoRAModule).

    ``buffers``: (lora_a, lora_b, slice_scales) of :func:`slot_buffers` this module is entry ``entry``
    of (a stacked parameter's, shared with the other entries); None: its own."""

    def __init__(self, module: LoRAModule, max_loras: int, max_lora_rank: int, device, dtype: torch.dtype,
                 buffers: tuple[torch.Tensor, ...] | None = None, entry: int = 0):
        self.module = module
        if buffers is None:
            buffers = slot_buffers(module, 1, max_loras, max_lora_rank, device, dtype)
        self.lora_a = buffers[0][entry]  # [max_loras, n, R, K]
        self.lora_b = buffers[1][entry]  # [max_loras, N, R] (N contiguous on the CPU: zeros_b)
        self.slice_scales = buffers[2][entry]  # [max_loras, n]
        # DoRA's column scales only where the layer applies them (not an expert: 84 MiB a slot at Qwen3-30B-A3B)
        self.column_scales = torch.ones(max_loras, module.out_features, dtype=torch.float32,
                                        device=device) if module.dora else None  # [max_loras, N]

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor of the module's slots."""
        scales = () if self.column_scales is None else (self.column_scales,)
        return self.lora_a, self.lora_b, self.slice_scales, *scales

    def reset(self, slot: int) -> None:
        """Zero ``slot``'s factors and scalings; its column scales back to 1."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slice_scales[slot].zero_()
        if self.column_scales is not None:
            self.column_scales[slot].fill_(1.0)

    def write(self, slot: int, pairs: tuple) -> bool:
        """Write one adapter's per-slice pairs (a reset slot); whether any carries a DoRA column scale
        (never on a module without DoRA: adapters.lora refuses it there)."""
        dora, scalings = False, torch.zeros(len(pairs))
        for j, (pair, offset, width) in enumerate(zip(pairs, self.module.slice_offsets, self.module.slice_sizes)):
            if pair is None:
                continue
            rank = pair.a.shape[0]
            _copy(self.lora_a[slot, j, :rank], pair.a)  # [r_j, K]
            _copy(self.lora_b[slot, offset:offset + width, :rank], pair.b)  # [N_j, r_j]
            scalings[j] = pair.scaling
            if pair.column_scale is not None:  # DoRA
                dora = True
                _copy(self.column_scales[slot, offset:offset + width], pair.column_scale)
        self.slice_scales[slot].copy_(scalings)  # one copy per module, not one per slice
        return dora


class LoRASlots:
    """``max_loras`` LoRA slots of rank ``max_lora_rank`` for every LoRA-capable module of ``spec``."""

    def __init__(self, spec: ModelSpec, max_loras: int, max_lora_rank: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if max_loras < 0 or max_lora_rank < 0 or (max_loras > 0 and max_lora_rank == 0):
            raise ValueError(f"need max_loras >= 0 and max_lora_rank > 0, got {max_loras}, {max_lora_rank}")
        self.spec, self.num_slots, self.max_rank = spec, max_loras, max_lora_rank
        stacks: dict[str, tuple[torch.Tensor, ...]] = {}  # stacked parameter path -> its entries' buffers
        self._modules = {}
        for m in spec.modules:
            if m.stacked is None:
                self._modules[m.key] = ModuleSlots(m, max_loras, max_lora_rank, device, dtype)
                continue
            path, entry, entries = m.stacked
            if path not in stacks:
                stacks[path] = slot_buffers(m, entries, max_loras, max_lora_rank, device, dtype)
            assert stacks[path][0].shape[-1] == m.in_features and stacks[path][1].shape[-2] == m.out_features, m.key
            self._modules[m.key] = ModuleSlots(m, max_loras, max_lora_rank, device, dtype, stacks[path], entry)
        self.slot_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras], 0 = empty
        # a slot's rank where its adapter has LoRA on a stacked module (an expert), else 0: the MoE block
        # reads it in place of slot_ranks, so an adapter without expert LoRA runs no expert LoRA op
        self.expert_ranks = torch.zeros(max_loras, dtype=torch.int32, device=device)  # [max_loras]
        # host bookkeeping (no device sync): the runner skips the column-scale epilogue without DoRA
        self.host_dora = np.zeros(max_loras, dtype=bool)  # [max_loras] slot holds DoRA column scales

    def weights(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(lora_a [max_loras, n, R, K], lora_b [max_loras, N, R]) of one layer's module ``name``."""
        module = self._modules[(layer, name)]
        return module.lora_a, module.lora_b

    def scales(self, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(slice_scales [max_loras, n], column_scales [max_loras, N] or None for a module without DoRA)
        float32 of one layer's module ``name``."""
        module = self._modules[(layer, name)]
        return module.slice_scales, module.column_scales

    @property
    def nbytes(self) -> int:
        """Device bytes allocated for all slots."""
        return sum(t.numel() * t.element_size() for module in self._modules.values() for t in module.tensors)

    def write(self, slot: int, adapter: LoRAWeights) -> None:
        """Zero ``slot`` everywhere, then write the adapter's factors (already validated) into it."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        assert adapter.rank <= self.max_rank, f"rank {adapter.rank} > max rank {self.max_rank}"
        for module in self._modules.values():
            module.reset(slot)
        self.host_dora[slot] = False
        experts = False
        for key, pairs in adapter.modules.items():
            module = self._modules[key]
            if module.write(slot, pairs):
                self.host_dora[slot] = True
            experts = experts or (module.module.stacked is not None and any(p is not None for p in pairs))
        self.slot_ranks[slot] = adapter.rank
        self.expert_ranks[slot] = adapter.rank if experts else 0

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty and reset its DoRA column scales to 1 (its stale weights are unread: no
        token maps to it, and write() zeroes them)."""
        self.slot_ranks[slot] = 0
        self.expert_ranks[slot] = 0
        self.host_dora[slot] = False
        for module in self._modules.values():
            if module.column_scales is not None:
                module.column_scales[slot].fill_(1.0)


class PromptSlots:
    """``max_prompt_adapters`` soft-prompt slots of up to ``max_prompt_adapter_tokens`` virtual tokens."""

    def __init__(self, spec: ModelSpec, max_prompt_adapters: int, max_prompt_adapter_tokens: int, device="cpu",
                 dtype: torch.dtype = torch.float32):
        if max_prompt_adapters < 0 or max_prompt_adapter_tokens < 0 or (
                max_prompt_adapters > 0 and max_prompt_adapter_tokens == 0):
            raise ValueError("need max_prompt_adapters >= 0 and max_prompt_adapter_tokens > 0 when prompt "
                             f"adapters are enabled, got {max_prompt_adapters}, {max_prompt_adapter_tokens}")
        self.num_slots, self.max_tokens = max_prompt_adapters, max_prompt_adapter_tokens
        self.embeddings = torch.zeros(max_prompt_adapters, max_prompt_adapter_tokens, spec.hidden_size,
                                      dtype=dtype, device=device)  # [P, max_tokens, hidden]
        self.num_virtual_tokens = torch.zeros(max_prompt_adapters, dtype=torch.int32, device=device)  # [P]

    @property
    def nbytes(self) -> int:
        """Device bytes allocated for all slots."""
        return self.embeddings.numel() * self.embeddings.element_size()

    def write(self, slot: int, adapter: PromptWeights) -> None:
        """Zero ``slot``, then write the soft prompt into its first num_virtual_tokens rows."""
        assert 0 <= slot < self.num_slots, f"slot {slot} out of range [0, {self.num_slots})"
        n = adapter.num_virtual_tokens
        assert n <= self.max_tokens, f"{n} virtual tokens > {self.max_tokens}"
        self.embeddings[slot].zero_()
        _copy(self.embeddings[slot, :n], adapter.embeddings)  # [n, hidden]
        self.num_virtual_tokens[slot] = n

    def clear(self, slot: int) -> None:
        """Mark ``slot`` empty."""
        self.num_virtual_tokens[slot] = 0
