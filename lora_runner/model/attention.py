"""Paged attention in plain torch for a flat batch of mixed prefill chunks and decodes.

One layer's cache is ``kv_layer [2, num_blocks, block_size, num_kv_heads, head_dim]`` (0 = K, 1 = V);
token position p of a sequence lives at slot ``block_table[p // block_size] * block_size + p % block_size``.

Each step: the new tokens' K/V are written at their slots, then every sequence's context (cached +
new) is gathered through its block table into a padded ``[B, max_seq_len]`` batch and attended by
one ``scaled_dot_product_attention`` call with a per-sequence causal (optionally sliding-window)
mask (a decode-only batch needs just a [B, max_seq_len] key mask; GQA query heads share their KV
head through ``enable_gqa`` rather than a per-head copy). There is no per-token or per-sequence
Python loop and no host sync, so the same code runs on CPU and GPU and can be captured in a CUDA
graph when the batch shapes (T, B, max_query_len, max_seq_len) are fixed.

Padding every sequence to the step's longest query and context would make 8 decodes beside one
2,000-token prefill chunk each compute (and gather) the chunk's whole rectangle (issue 23 item 11).
So when the lengths are on the host (CPU tensors: reading them costs no sync) the step is split
into length groups (``length_groups``): decodes apart from prefill chunks, each group padded to at
most MAX_PADDING times its own query x context scores, one padded call per group. A step of similar
lengths stays one call. Device tensors keep the single call (graph-safe); on CUDA the Triton
kernels below already cost each sequence its own length.

Sliding windows (Mistral, Qwen2's windowed layers, Gemma 2's even layers) are one more mask term, so
contexts longer than the window are exact; blocks that left the window stay allocated (no memory
saving). Logit soft-capping (Gemma 2: ``cap * tanh(scale * q.k / cap)`` before the mask and softmax)
computes the scores explicitly instead of calling ``scaled_dot_product_attention``, which has no cap.

On CUDA (Triton importable) ``paged_attention`` runs the Triton kernels of
lora_runner/model/paged_attention.py instead: they read the context through the block tables in
place (no padded gather) and take context lengths from ``seq_lens`` at run time, so a decode
graph does not depend on ``max_seq_len``. ``backend`` (or the environment variable
LORA_RUNNER_ATTENTION) picks "auto" (Triton on CUDA, torch elsewhere), "triton" (CPU tensors run
the Triton interpreter: tests) or "torch".
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import numpy as np
import torch
import torch.nn.functional as F

from lora_runner.model import batch_invariant
from lora_runner.model.forward_context import AttentionMetadata
from punica_kernels import invariant

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("auto", "triton", "torch")
BACKEND_ENV = "LORA_RUNNER_ATTENTION"
_TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the torch path pads a group of sequences to its longest query and context at most this many times
# their own score count (length_groups)
MAX_PADDING = 2.0


@functools.cache
def triton_attention():
    """The Triton kernels module, or None when Triton cannot be imported (a warning says why).

    Imported on first use, not at module level: Triton is optional, and without it the torch path
    must still import and run.
    """
    try:
        return importlib.import_module("lora_runner.model.paged_attention")
    except ImportError as error:
        logger.warning("Triton paged attention unavailable, using the torch path: %s", error)
        return None


def resolve_backend(backend: str | None, query: torch.Tensor) -> str:
    """"triton" or "torch" for `query`; None reads LORA_RUNNER_ATTENTION (default "auto")."""
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        use_triton = query.is_cuda and query.dtype in _TRITON_DTYPES and triton_attention() is not None
        return "triton" if use_triton else "torch"
    if backend == "triton" and triton_attention() is None:
        raise RuntimeError("attention backend 'triton' asked for, but Triton cannot be imported")
    return backend


def write_kv(kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store key/value [T, num_kv_heads, head_dim] at slot_mapping [T] of kv_layer; slot -1 is skipped.

    Padding tokens (slot -1) are redirected to a real token's slot with that token's own K/V, so
    every duplicate index writes identical data: deterministic, sync-free and graph-safe.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    flat = kv_layer.view(2, -1, *kv_layer.shape[-2:])  # [2, num_blocks * block_size, H_kv, D]
    if slot_mapping.is_cpu and slot_mapping.numpy().min() >= 0:
        # every token real (read through numpy: a host read, never a device op): the redirect below is the identity, so
        # writing K and V at their slots directly stores the same data in a third of the torch calls
        flat[0].index_copy_(0, slot_mapping, key.to(kv_layer.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_layer.dtype))
        return
    valid = slot_mapping >= 0  # [T]
    first_valid = torch.argmax(valid.to(torch.int32))  # index of the first real token (0 if none)
    token_ids = torch.arange(num_tokens, device=slot_mapping.device)  # [T]
    source = torch.where(valid, token_ids, first_valid)  # [T]: whose K/V each row writes
    target = slot_mapping[source].clamp(min=0)  # [T]
    any_valid = valid.any()  # [] bool; with no real token every row rewrites slot 0 unchanged
    new = torch.stack((key[source], value[source])).to(kv_layer.dtype)  # [2, T, H_kv, D]
    new = torch.where(any_valid, new, flat[:, target])  # [2, T, H_kv, D]
    flat.index_copy_(1, target, new)


def _token_rows(attn: AttentionMetadata, num_tokens: int, max_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index [T], row within that sequence's new tokens [T]) of every flat token.

    Tokens past query_start_loc[-1] (graph padding) get sequence index B.
    """
    starts = attn.query_start_loc.to(torch.int64)  # [B+1]
    token_ids = torch.arange(num_tokens, device=starts.device)  # [T]
    seq = torch.searchsorted(starts[1:], token_ids, right=True)  # [T] in [0, B]
    row = token_ids - starts[seq.clamp(max=starts.shape[0] - 2)]  # [T]
    return seq, row.clamp(0, max_query_len - 1)


def token_seq_lens(attn: AttentionMetadata, num_tokens: int) -> torch.Tensor:
    """Context length (seq_lens) of each flat token's sequence, [T] int64; padding tokens get 0."""
    seq, _ = _token_rows(attn, num_tokens, max(attn.max_query_len, 1))
    seq_lens = torch.cat((attn.seq_lens.to(torch.int64), seq.new_zeros(1)))  # [B+1]
    return seq_lens[seq]


def paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                    sliding_window: int | None = None, backend: str | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """Attend each new token to its sequence's cached + new tokens (causal); returns [T, H, D].

    query [T, H, D] (RoPE applied); kv_layer [2, num_blocks, block_size, H_kv, D] already holding
    this step's K/V (see write_kv); H must be a multiple of H_kv (GQA: head h reads KV head
    h // (H / H_kv)). `sliding_window` w: a token at position p sees positions p-w+1..p only.
    `softcap` c: scores s = scale * q.k become c * tanh(s / c) before the softmax.
    Padding tokens (past query_start_loc[-1]) get zeros. backend: see the module docstring. In the
    batch-invariant mode (punica_kernels.invariant) each token alone, or on Triton every token through the
    prefill kernel with fixed key tiles (lora_runner.model.batch_invariant).
    """
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap!r}")
    use_triton = resolve_backend(backend, query) == "triton"
    if invariant.enabled():
        if use_triton:
            return batch_invariant.triton_paged_attention(query, kv_layer, attn, scale, sliding_window, softcap)
        return batch_invariant.paged_attention(query, kv_layer, attn, scale, sliding_window, softcap, _attend)
    if use_triton:
        return _triton_paged_attention(query, kv_layer, attn, scale, sliding_window, softcap)
    return _torch_paged_attention(query, kv_layer, attn, scale, sliding_window, softcap)


def _triton_paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                            sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """The decode kernel when every sequence adds one token and there is no padding token (graph
    padding comes as extra sequences), the prefill kernel otherwise; both read seq_lens at run time."""
    kernels = triton_attention()
    num_seqs = attn.seq_lens.shape[0]
    if attn.max_query_len == 1 and query.shape[0] == num_seqs:
        return kernels.decode_attention(query, kv_layer, attn.block_tables, attn.seq_lens, scale, sliding_window,
                                        softcap=softcap)
    return kernels.prefill_attention(query, kv_layer, attn.block_tables, attn.seq_lens, attn.query_start_loc,
                                     attn.max_query_len, scale, sliding_window, softcap=softcap)


def _torch_paged_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                           sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
    """The gather + scaled_dot_product_attention path (CPU, and the oracle of the Triton kernels).

    With host-readable lengths (CPU tensors) the sequences are split into length groups (see
    length_groups) so no sequence is padded to a much longer one's query or context; each group is
    one padded call. Device tensors keep the single padded call: reading their lengths would sync.
    """
    num_tokens = query.shape[0]
    if num_tokens == 0 or attn.seq_lens.shape[0] == 0:
        return query.new_zeros(query.shape)
    groups = _host_length_groups(attn)
    if groups is None:
        return _padded_attention(query, kv_layer, attn, scale, sliding_window, softcap)
    out = query.new_zeros(query.shape)  # rows of no sequence (graph padding) stay zero
    for seqs in groups:
        group_attn, tokens = _group_metadata(attn, seqs)
        out.index_copy_(0, tokens, _padded_attention(query.index_select(0, tokens), kv_layer, group_attn, scale,
                                                     sliding_window, softcap))
    return out


def length_groups(query_lens: np.ndarray, seq_lens: np.ndarray,
                  max_padding: float = MAX_PADDING) -> list[np.ndarray] | None:
    """Sequences grouped so each group's padded work is at most `max_padding` times its own.

    A padded group of n sequences computes n * max(query_lens) * max(seq_lens) scores; its own work
    is sum(query_lens * seq_lens). Returns None when the whole batch is within the bound (one call),
    else the sequence indices of each group (ascending; a sequence without new tokens is in none).
    Decodes (query length 1) and prefill chunks are grouped apart, so no decode is padded to a
    chunk's query length, each greedily from the longest context down: the step's padded work
    stays within the bound whatever one long sequence beside short ones is.
    """
    own = query_lens * seq_lens  # [B]
    total = int(own.sum())
    if query_lens.shape[0] * int(query_lens.max()) * int(seq_lens.max()) <= max_padding * total:
        return None
    groups = []
    for seqs in (np.flatnonzero(query_lens == 1), np.flatnonzero(query_lens > 1)):
        seqs = seqs[np.argsort(-seq_lens[seqs], kind="stable")]  # longest context first
        members, group_own, group_q = [], 0, 0
        for seq, q, s, work in zip(seqs.tolist(), query_lens[seqs].tolist(), seq_lens[seqs].tolist(),
                                   own[seqs].tolist()):
            # the first member has the group's longest context: the padded width is fixed
            if members and (len(members) + 1) * max(group_q, q) * group_s > max_padding * (group_own + work):
                groups.append(np.sort(np.array(members)))
                members = []
            if not members:
                group_own, group_q, group_s = 0, 0, s
            members.append(seq)
            group_own, group_q = group_own + work, max(group_q, q)
        if members:
            groups.append(np.sort(np.array(members)))
    return groups


def _host_length_groups(attn: AttentionMetadata) -> list[np.ndarray] | None:
    """length_groups of `attn` when its lengths live on the host; None (one call) otherwise.

    Runs in every layer: the common step (similar lengths) costs a few numpy ops and no allocation
    beyond them; the padded size it checks is the one the single call would use (attn's host ints).
    """
    if not (attn.seq_lens.is_cpu and attn.query_start_loc.is_cpu):
        return None
    starts = attn.query_start_loc.numpy().astype(np.int64)  # [B+1]
    query_lens = starts[1:] - starts[:-1]  # [B]
    seq_lens = attn.seq_lens.numpy().astype(np.int64)  # [B]
    own = int(query_lens @ seq_lens)
    if seq_lens.shape[0] * max(attn.max_query_len, 1) * max(attn.max_seq_len, 1) <= MAX_PADDING * own:
        return None
    return length_groups(query_lens, seq_lens)


def _group_metadata(attn: AttentionMetadata, seqs: np.ndarray) -> tuple[AttentionMetadata, torch.Tensor]:
    """The metadata of sequences `seqs` (host indices) alone, and their tokens' rows [T_g] of the flat batch."""
    starts = attn.query_start_loc.numpy().astype(np.int64)  # [B+1]
    query_lens = starts[seqs + 1] - starts[seqs]  # [G]
    group_starts = np.concatenate(([0], np.cumsum(query_lens)))  # [G+1]
    tokens = np.arange(group_starts[-1]) + np.repeat(starts[seqs] - group_starts[:-1], query_lens)  # [T_g]
    tokens = torch.from_numpy(tokens)
    seq_index = torch.from_numpy(seqs)
    seq_lens = attn.seq_lens.index_select(0, seq_index)  # [G]
    group_attn = AttentionMetadata(
        slot_mapping=attn.slot_mapping.index_select(0, tokens),
        query_start_loc=torch.from_numpy(group_starts).to(attn.query_start_loc.dtype),
        seq_lens=seq_lens, block_tables=attn.block_tables.index_select(0, seq_index),
        max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()))
    return group_attn, tokens


def _padded_attention(query: torch.Tensor, kv_layer: torch.Tensor, attn: AttentionMetadata, scale: float,
                      sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    """All of `attn`'s sequences in one padded batch [B, max_query_len, max_seq_len]: one
    scaled_dot_product_attention call, no Python loop, no host sync (graph-safe)."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = attn.seq_lens.shape[0]
    k_ctx, v_ctx, key_valid, keys = _gather_context(kv_layer, attn, query.dtype)
    seq_lens = attn.seq_lens.to(torch.int64)  # [B]
    if attn.max_query_len == 1 and num_tokens == num_seqs:
        # Pure decode: token b is sequence b's last position, so the causal term is key_valid itself
        # and no [B, MQ, MS] mask, query scatter or output gather is needed.
        mask = key_valid  # [B, MS]
        if sliding_window is not None:
            mask = mask & (keys[None, :] >= seq_lens[:, None] - sliding_window)
        out = _attend(query[:, :, None], k_ctx, v_ctx, mask[:, None, None], scale, softcap)  # [B, H, 1, D]
        return out.view(num_tokens, num_heads, head_dim)

    # Mask: key j of sequence b is visible to its query row i at position pos[b, i] when j <= pos and
    # j < seq_len (and j > pos - window); pad rows sit past the context so they are never fully masked.
    max_q = max(attn.max_query_len, 1)
    query_lens = (attn.query_start_loc[1:] - attn.query_start_loc[:-1]).to(torch.int64)  # [B]
    rows = torch.arange(max_q, device=query.device)  # [MQ]
    positions = (seq_lens - query_lens)[:, None] + rows[None, :]  # [B, MQ]
    mask = (keys[None, None, :] <= positions[:, :, None]) & key_valid[:, None, :]  # [B, MQ, MS]
    if sliding_window is not None:
        mask &= keys[None, None, :] > positions[:, :, None] - sliding_window

    # Scatter the flat queries into [B, MQ] rows; graph padding goes to one spare row.
    seq, row = _token_rows(attn, num_tokens, max_q)
    flat_row = torch.where(seq < num_seqs, seq * max_q + row, num_seqs * max_q)  # [T]
    padded_q = query.new_zeros(num_seqs * max_q + 1, num_heads, head_dim)  # [B*MQ+1, H, D]
    padded_q[flat_row] = query
    q_batch = padded_q[:-1].view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)  # [B, H, MQ, D]

    out = _attend(q_batch, k_ctx, v_ctx, mask[:, None], scale, softcap)  # [B, H, MQ, D]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)  # [B*MQ, H, D]
    out = torch.cat((out, out.new_zeros(1, num_heads, head_dim)))  # [B*MQ+1, H, D]
    return out[flat_row]  # [T, H, D]


def _gather_context(kv_layer: torch.Tensor, attn: AttentionMetadata,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every sequence's context gathered through its block table, with K/V outside it zeroed.

    Returns K and V [B, H_kv, MS, D] in `dtype`, key_valid [B, MS] (key j < seq_len) and the key
    positions [MS]; MS is max_seq_len clipped to what the block tables can address.
    """
    num_seqs = attn.seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = kv_layer.shape[2:]
    max_blocks = min(-(-max(attn.max_seq_len, 1) // block_size), attn.block_tables.shape[1])
    max_s = min(max(attn.max_seq_len, 1), max_blocks * block_size)  # a padded max_seq_len may exceed the tables
    tables = attn.block_tables[:, :max_blocks].reshape(-1)  # [B * MB]
    # index_select on the flattened blocks: advanced indexing (kv_layer[:, tables]) is several times slower on CPU
    context = kv_layer.flatten(2).index_select(1, tables)  # [2, B * MB, block_size * H_kv * D], a fresh tensor
    keys = torch.arange(max_s, device=kv_layer.device)  # [MS]
    key_valid = keys[None, :] < attn.seq_lens.to(torch.int64)[:, None]  # [B, MS]
    # Zero K/V outside the context: stale blocks may hold anything (even NaN), and 0 * NaN = NaN.
    context = context.view(2, num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    _zero_outside_context(context, key_valid)
    context = context[:, :, :max_s].to(dtype)
    context = context.transpose(2, 3)  # [2, B, H_kv, MS, D]
    return context[0], context[1], key_valid, keys


def _zero_outside_context(context: torch.Tensor, key_valid: torch.Tensor) -> None:
    """Zero the gathered context [2, B, MB * block_size, H_kv, D] (contiguous) where key_valid
    [B, MS] (MS <= MB * block_size) is False; positions past MS are left as they are (never read).

    On the host the few invalid positions (the tail of each sequence's last block, and the blocks of
    sequences shorter than the longest) are found first and only their rows are written: the same
    zeros as a broadcast masked_fill, ~10x cheaper in a decode step. On a device finding them would
    sync: the masked_fill.
    """
    max_s = key_valid.shape[1]
    if not key_valid.is_cpu:
        context[:, :, :max_s].masked_fill_(~key_valid[None, :, :, None, None], 0)
        return
    invalid = np.flatnonzero(~key_valid.numpy())  # [I] flat (sequence, position) indices, read through numpy
    if invalid.size == 0:
        return
    positions = context.shape[2]
    rows = context.view(2, context.shape[1] * positions, -1)  # [2, B * MB * block_size, H_kv * D]
    sequence, position = np.divmod(invalid, max_s)
    rows.index_fill_(1, torch.from_numpy(sequence * positions + position), 0)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(scale * q @ k.T, capped, masked) @ v for q [B, H, MQ, D], k/v [B, H_kv, MS, D] (query
    head h reads KV head h // (H / H_kv)), mask [B, 1, MQ, MS]; returns [B, H, MQ, D]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    batch, num_heads, max_q, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, max_q, head_dim)  # [B, H_kv, G, MQ, D]
    scores = torch.matmul(q, k[:, :, None].transpose(-1, -2)) * scale  # [B, H_kv, G, MQ, MS]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    # a padded query row may see no key (NaN here, as with SDPA): such rows are never returned
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v[:, :, None]).view(batch, num_heads, max_q, head_dim)
