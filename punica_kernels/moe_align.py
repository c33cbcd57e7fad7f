"""The "moe align" step of the fused MoE kernels: (token, expert) pairs sorted into blocks of one group.

Each token t routed to experts topk_ids[t, 0..k-1] makes k pairs, numbered p = t * k + j (the row of
the kernels' [P, N] output buffers, P = T * k). A *group* is an expert, or with expert LoRA an
(expert, adapter slot) pair: the pairs are stably sorted by group and every group is padded to a whole
number of blocks of ``block_m`` rows, so each block of the sorted order belongs to one expert (one GEMM
operand) and one slot (one LoRA A/B). As vLLM's ``moe_align_block_size`` / SGLang's, in its semantics;
written here as a handful of torch ops with no host sync (the same code on CPU and CUDA)::

    align = moe_align(topk_ids, num_experts, block_m, pair_slots=slots, num_slots=L)
    align.sorted_pairs   # [max_padded] int32: pair ids block by block; padding rows hold P (masked)
    align.block_experts  # [max_blocks] int32: each block's expert, -1 for a block past the last group
    align.block_slots    # [max_blocks] int32: each block's adapter slot, -1 for none (or past the end)

Sizes depend only on (T, k, number of groups, block_m), never on the routing, so a decode graph
captured over them replays for any routing: ``max_blocks = cdiv(P, block_m) + min(P, groups)`` (every
non-empty group wastes at most one partial block); blocks past the routing's last group have expert -1
and the kernels skip them. Empty experts have no block at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MoEAlignment:
    """Pairs grouped into blocks; see the module docstring for the meaning of each field."""

    sorted_pairs: torch.Tensor  # [max_blocks * block_m] int32, P for padding rows
    block_experts: torch.Tensor  # [max_blocks] int32, -1: no work
    block_slots: torch.Tensor  # [max_blocks] int32, -1: no adapter (or no work)
    num_pairs: int  # P = T * k
    top_k: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


def max_blocks(num_pairs: int, num_groups: int, block_m: int) -> int:
    """Blocks the alignment of ``num_pairs`` pairs over ``num_groups`` groups can need, at most."""
    return -(-num_pairs // block_m) + min(num_pairs, num_groups)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, pair_slots: torch.Tensor | None = None,
              num_slots: int = 0) -> MoEAlignment:
    """Sort the (token, expert) pairs of ``topk_ids`` [T, k] into blocks of ``block_m`` rows of one group.

    Args:
        topk_ids: [T, k] integer expert of each token's j-th choice, in [0, num_experts).
        num_experts: E.
        block_m: rows per block (the kernels' BLOCK_M), a power of two >= 16.
        pair_slots: [T * k] integer adapter slot of each pair (its token's), -1 or >= num_slots: none.
            None: group by expert only (every block's slot is -1).
        num_slots: the slots' count L (groups are (expert, slot) with L + 1 slot values, the last "none").
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs, device = num_tokens * top_k, topk_ids.device
    slot_values = num_slots + 1 if pair_slots is not None else 1
    num_groups = num_experts * slot_values
    experts = topk_ids.reshape(-1).to(torch.int64)  # [P]
    if pair_slots is None:
        groups = experts
    else:
        slots = pair_slots.to(torch.int64)
        slots = torch.where((slots >= 0) & (slots < num_slots), slots, num_slots)  # [P] L = no adapter
        groups = experts * slot_values + slots  # [P]
    order = torch.argsort(groups, stable=True)  # [P] pair ids by group
    # counts by scatter, not bincount: bincount sizes its output from the data (a host sync on CUDA)
    counts = torch.zeros(num_groups, dtype=torch.int64, device=device).scatter_add_(
        0, groups, torch.ones_like(groups))  # [G]
    padded = (counts + block_m - 1) // block_m * block_m  # [G]
    padded_ends = torch.cumsum(padded, 0)  # [G]
    sorted_starts = torch.cumsum(counts, 0) - counts  # [G] each group's first position in `order`
    sorted_groups = groups[order]  # [P]
    within = torch.arange(num_pairs, device=device) - sorted_starts[sorted_groups]  # [P] rank in its group
    destination = padded_ends[sorted_groups] - padded[sorted_groups] + within  # [P]

    blocks = max_blocks(num_pairs, num_groups, block_m)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, destination, order.to(torch.int32))
    block_starts = torch.arange(blocks, device=device) * block_m  # [max_blocks]
    block_groups = torch.searchsorted(padded_ends, block_starts, right=True)  # [max_blocks], G past the end
    used = block_groups < num_groups
    block_experts = torch.where(used, block_groups // slot_values, -1).to(torch.int32)
    block_slot = block_groups % slot_values
    block_slots = torch.where(used & (block_slot < num_slots), block_slot, -1).to(torch.int32)
    return MoEAlignment(sorted_pairs, block_experts, block_slots, num_pairs, top_k, block_m)
