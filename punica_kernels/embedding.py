"""Embedding LoRA's gather shrink: each token's row of its adapter's (transposed) A, by token id.

PEFT's embedding LoRA gives token t of slot s the delta ``B_s @ A_s[:, t]``: the shrink is a gather
(no matmul), the expand is :func:`punica_kernels.lora_expand` with the same meta::

    embedding_shrink(input_ids, lora_a, meta, inter)    # inter[t, 0] = lora_a[s, input_ids[t]]
    lora_expand(hidden, inter, lora_b, meta, (hidden_size,))

``lora_a`` is [max_loras, V, R]: A transposed, so a token's R values are contiguous. Backends as in
:mod:`punica_kernels.ops`: Triton on CUDA (or the interpreter for CPU tensors with
backend="triton"), torch elsewhere; float64 goes to torch (the oracle).
"""

from __future__ import annotations

import torch

from . import ops, reference
from .meta import LoRAMeta, same_device

try:
    from . import embedding_triton
except ImportError:  # no triton: ops._resolve never picks it then
    embedding_triton = None


def embedding_shrink(input_ids: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                     out: torch.Tensor | None = None, *, backend: str = "auto") -> torch.Tensor:
    """Gather each LoRA token's row of its adapter's A.

    Semantics: out[t, 0, :] = lora_a[s, input_ids[t], :] for s = token_slots[t] >= 0 (the meta's
    table); rows of slot -1 tokens are not written; an id outside [0, V) gives zeros.

    Args:
        input_ids: [T] integer token ids on the meta's device.
        lora_a: [max_loras, V, R] float16, bfloat16, float32 (float64 on torch only).
        meta: holding this batch's table (``meta.num_tokens == T``).
        out: [T, 1, R] float32 (float64 for float64 lora_a); allocated when None.
        backend: "auto", "triton" or "torch".

    Returns out; with it, ``lora_expand(y, out, lora_b, meta, (N,))`` adds ``scaling * B @ A[:, t]``.
    No allocation (given out) and no host sync on the Triton path: CUDA-graph safe.

    Raises:
        ValueError: shapes, dtypes or devices that do not match, or a meta without a table.
        BackendUnavailableError: backend="triton" without an importable Triton.
    """
    _check(input_ids, lora_a, meta)
    if out is None:
        out = lora_a.new_empty((input_ids.shape[0], 1, lora_a.shape[2]), dtype=reference.compute_dtype(lora_a.dtype))
    ops._check_inter(out, input_ids.shape[0], 1, lora_a.shape[2], lora_a.dtype, meta)
    if ops._resolve(backend, lora_a) == "torch":
        return embedding_shrink_reference(input_ids, lora_a, meta, out)
    return embedding_triton.embedding_shrink(input_ids, lora_a, meta, out)


def embedding_shrink_reference(input_ids: torch.Tensor, lora_a: torch.Tensor, meta: LoRAMeta,
                               out: torch.Tensor) -> torch.Tensor:
    """Torch path (CPU serving and, in float64, the oracle): same semantics, no host sync."""
    max_loras, vocab_size, _ = lora_a.shape
    slots = meta.token_slots[:input_ids.shape[0]]  # [T]
    has_slot = (slots >= 0) & (slots < max_loras)  # [T]
    in_vocab = (input_ids >= 0) & (input_ids < vocab_size)  # [T]
    rows = lora_a[slots.clamp(0, max_loras - 1), input_ids.clamp(0, vocab_size - 1)].to(out.dtype)  # [T, R]
    rows = rows.masked_fill(~in_vocab[:, None], 0.0)
    out[:, 0] = torch.where(has_slot[:, None], rows, out[:, 0])
    return out


def _check(input_ids, lora_a, meta: LoRAMeta) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype.is_floating_point \
            or input_ids.dtype == torch.bool:
        raise ValueError("input_ids must be a 1-D integer tensor")
    if not same_device(input_ids.device, meta.device):
        raise ValueError(f"input_ids is on {input_ids.device} but meta is on {meta.device}")
    ops._check_prepared(meta, input_ids.shape[0], "input_ids")
    ops._check_tensor("lora_a", lora_a, 3, None, meta)
    if lora_a.shape[0] != meta.max_loras or lora_a.shape[1] < 1 or lora_a.shape[2] < 1:
        raise ValueError(f"lora_a must be [max_loras={meta.max_loras}, V>=1, R>=1], got {list(lora_a.shape)}")
