"""The gather shrink of embedding LoRA in Triton: each token's row of its adapter's A, by token id.

One program per ``BLOCK_M`` tokens (grid ``cdiv(T, BLOCK_M)``: it depends on T only, so a CUDA graph
replays it for any adapter mix); int64 offsets; the rank is one padded tile of ``BLOCK_R >= RANK``
columns. No allocation, no host sync. CPU tensors run under the interpreter (as triton_ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .meta import LoRAMeta
from .triton_ops import kernel_for

BLOCK_M = 32  # tokens per program: a gather of R values per token is tiny, so batch tokens


@triton.jit(do_not_specialize=["num_tokens"])
def _embedding_shrink_kernel(
    ids_ptr, slots_ptr, a_ptr, out_ptr,
    num_tokens, vocab_size, max_loras,
    stride_as, stride_av, stride_ar,
    stride_ot, stride_or,
    RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] tokens
    m_mask = offs_m < num_tokens
    slots = tl.load(slots_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)  # [BLOCK_M]
    ids = tl.load(ids_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)  # [BLOCK_M]
    has_slot = m_mask & (slots >= 0) & (slots < max_loras)  # rows written
    in_vocab = has_slot & (ids >= 0) & (ids < vocab_size)  # rows read (others get zeros)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK  # [BLOCK_R]
    a_rows = slots * stride_as + ids * stride_av  # [BLOCK_M] int64
    values = tl.load(a_ptr + a_rows[:, None] + offs_r[None, :].to(tl.int64) * stride_ar,
                     mask=in_vocab[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + offs_r[None, :].to(tl.int64) * stride_or
    tl.store(out_ptrs, values.to(tl.float32), mask=has_slot[:, None] & r_mask[None, :])


def embedding_shrink(input_ids: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                     out: torch.Tensor) -> torch.Tensor:
    """Semantics: out[t, 0, :] = lora_a[s, input_ids[t], :] (as float32) for s = token_slots[t] >= 0.

    input_ids [T] int; lora_a [max_loras, V, R] (fp16/bf16/fp32); out [T, 1, R] float32, rows of
    slot -1 tokens not written (an id outside [0, V) gives a zero row). Grid cdiv(T, BLOCK_M).
    """
    num_tokens = input_ids.shape[0]
    if num_tokens == 0:
        return out
    max_loras, vocab_size, rank = lora_a.shape
    grid = (triton.cdiv(num_tokens, BLOCK_M),)
    kernel_for(_embedding_shrink_kernel, input_ids.device)[grid](
        input_ids, meta.token_slots, lora_a, out,
        num_tokens, vocab_size, max_loras,
        *lora_a.stride(), out.stride(0), out.stride(2),
        RANK=rank, BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )
    return out
