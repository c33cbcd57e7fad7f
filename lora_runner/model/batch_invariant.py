"""Attention in the batch-invariant mode: each token over exactly its own keys, one call per token.

The torch path of lora_runner.model.attention pads a step's sequences to the longest query and
context (``scaled_dot_product_attention`` over a masked rectangle whose shape depends on the other
sequences and on how a prompt was chunked), and the Triton kernels pick decode or prefill by the
step. Here every new token t of a sequence, at position p, attends to keys lo..p of its sequence
(lo = p - window + 1 with a sliding window, else 0) in one call of shape [1, H, 1, D] x [1, H_kv,
p - lo + 1, D]: the shape, the values and so the summation order depend on the token alone, never
on its companions, the batch size or the chunk it came in. The cost is one call per token per
layer (measured in benchmarks/bench_batch_invariant.py).

On the Triton backend (CUDA) every token of every step, decode or prefill, goes through the one
prefill kernel (:func:`triton_paged_attention`): a token's row of a query tile reduces over key tiles
at fixed positions (multiples of BLOCK_N, ``aligned_keys``), so its sums do not depend on the chunk it
came in, on the other rows of its tile or on the step's kind. The decode kernel is never used in the
mode: it would give a decode token other bits than the prefill kernel gives the same token in a mixed
step, and its context split count follows the batch size. Key tiles past a row's position (or before
its window) are fully masked for that row and change none of its bits (probabilities 0, rescale 1).

The switch is punica_kernels.invariant's per-thread mode, which the model runner sets
(EngineConfig.batch_invariant); lora_runner.model.attention.paged_attention routes here while it
is on.
"""

from __future__ import annotations

import torch

from lora_runner.model.forward_context import AttentionMetadata


def paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                    sliding_window: int | None, softcap: float | None,
                    attend) -> torch.Tensor:
    """Semantics as lora_runner.model.attention.paged_attention (query [T, H, D] -> [T, H, D], padding
    tokens zero), each token computed alone by ``attend(q [1, H, 1, D], k, v [1, H_kv, L, D], mask
    [1, 1, 1, L], scale, softcap)`` over exactly its L visible keys."""
    out = query.new_zeros(query.shape)  # rows of no sequence (graph padding) stay zero
    starts = attn.query_start_loc.tolist()  # host tensors on CPU: no sync
    block_size = kv_layer.shape[2]
    for seq, seq_len in enumerate(attn.seq_lens.tolist()):
        begin, end = starts[seq], starts[seq + 1]
        if end == begin:
            continue
        blocks = attn.block_tables[seq, :-(-seq_len // block_size)].to(torch.int64)  # [nb]
        context = kv_layer.index_select(1, blocks).flatten(1, 2)[:, :seq_len]  # [2, S, H_kv, D]
        for token in range(begin, end):
            position = seq_len - (end - token)
            first = 0 if sliding_window is None else max(0, position - sliding_window + 1)
            # fresh contiguous copies: the same layout (and alignment) whatever slice they came from
            keys = context[0, first:position + 1].transpose(0, 1).to(query.dtype).contiguous()[None]  # [1, H_kv, L, D]
            values = context[1, first:position + 1].transpose(0, 1).to(query.dtype).contiguous()[None]
            mask = torch.ones(1, 1, 1, keys.shape[2], dtype=torch.bool, device=query.device)
            q = query[token].clone()[None, :, None]  # [1, H, 1, D]
            out[token] = attend(q, keys, values, mask, scale, softcap)[0, :, 0]
    return out


def triton_paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                           sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """Semantics as :func:`paged_attention`, every token through the Triton prefill kernel with its key
    tiles at fixed positions (lora_runner.model.paged_attention.prefill_attention, aligned_keys)."""
    from lora_runner.model import paged_attention as kernels  # triton is optional: imported where it runs

    return kernels.prefill_attention(query, kv_layer, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                     max(attn.max_query_len, 1), scale, sliding_window, softcap=softcap,
                                     aligned_keys=True)
