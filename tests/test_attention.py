"""Paged attention and KV writes vs a float64 per-sequence reference.

The cache starts NaN-filled; each sequence's context lives in shuffled blocks; batches mix decodes,
prefill chunks on top of cached context and fresh prompts, plus graph-style padding tokens.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from lora_runner.model.attention import paged_attention, token_seq_lens, write_kv
from lora_runner.model.forward_context import AttentionMetadata


def _batch(gen, query_lens, seq_lens, block_size, num_blocks, num_kv_heads, head_dim, num_padding, dtype, device):
    """Random K/V for every context position, cached part already in the cache, new part returned."""
    kv_layer = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    full_k, full_v, new_k, new_v, slots = [], [], [], [], []
    for b, (qlen, slen) in enumerate(zip(query_lens, seq_lens)):
        table = [free.pop() for _ in range(-(-slen // block_size))]
        block_tables[b, :len(table)] = torch.tensor(table)
        k = torch.randn(slen, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        v = torch.randn(slen, num_kv_heads, head_dim, generator=gen, dtype=torch.float64)
        pos = torch.arange(slen)
        slot = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
        cached = slen - qlen
        flat = kv_layer.view(2, -1, num_kv_heads, head_dim)
        flat[0, slot[:cached]], flat[1, slot[:cached]] = k[:cached].to(dtype), v[:cached].to(dtype)
        full_k.append(k)
        full_v.append(v)
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        slots.append(slot[cached:])
    pad = torch.zeros(num_padding, num_kv_heads, head_dim, dtype=torch.float64)
    starts = torch.tensor([0] + list(query_lens)).cumsum(0).to(torch.int32)
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots + [torch.full((num_padding,), -1)]).long().to(device),
        query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=block_tables.to(device), max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    new_k = torch.cat(new_k + [pad + 7.0]).to(dtype).to(device)
    new_v = torch.cat(new_v + [pad + 7.0]).to(dtype).to(device)
    return kv_layer.to(device), attn, new_k, new_v, full_k, full_v


def _reference(query, full_k, full_v, query_lens, scale, window, softcap=None):
    """float64 loop: each new token attends causally (and within the window) to its own context;
    `softcap` c caps the scaled scores s as c * tanh(s / c)."""
    outs, row = [], 0
    for k, v, qlen in zip(full_k, full_v, query_lens):
        slen, num_kv_heads = k.shape[0], k.shape[1]
        q = query[row:row + qlen].double()  # [qlen, H, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [slen, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, qlen, slen]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos = torch.arange(slen - qlen, slen)[:, None]
        kpos = torch.arange(slen)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
        row += qlen
    return torch.cat(outs)


MIXES = {
    "decode": ([1, 1, 1], [5, 17, 1]),
    "prefill": ([6, 3, 11], [6, 3, 11]),
    "mixed": ([1, 7, 4, 1], [9, 7, 13, 30]),  # decode, fresh prompt, chunk on cached context, long decode
}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("num_padding,softcap", [(2, None), (0, None), (0, 0.5), (2, 0.5)])
def test_paged_attention_matches_reference(mix, block_size, heads, window, num_padding, softcap):
    """No padding token: a decode-only batch takes the torch path's mask-free decode branch. A small
    soft cap (Gemma 2's tanh) changes every score measurably, so a dropped or misplaced cap fails."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((mix, block_size, heads, window, num_padding)).encode()))
    query_lens, seq_lens = MIXES[mix]
    num_heads, num_kv_heads = heads
    head_dim = 8
    kv_layer, attn, new_k, new_v, full_k, full_v = _batch(
        gen, query_lens, seq_lens, block_size, 64, num_kv_heads, head_dim, num_padding, torch.float32, "cpu")
    query = torch.randn(sum(query_lens) + num_padding, num_heads, head_dim, generator=gen)
    scale = 1 / math.sqrt(head_dim)
    write_kv(kv_layer, new_k, new_v, attn.slot_mapping)
    out = paged_attention(query, kv_layer, attn, scale, sliding_window=window, softcap=softcap)
    expected = _reference(query, full_k, full_v, query_lens, scale, window, softcap)
    assert out.shape == query.shape
    num_real = sum(query_lens)
    torch.testing.assert_close(out[:num_real].double(), expected, atol=1e-5, rtol=1e-5)
    assert (out[num_real:] == 0).all(), "padding tokens get zeros"


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_close_to_reference(dtype, tol):
    gen = torch.Generator().manual_seed(11)
    query_lens, seq_lens = MIXES["mixed"]
    kv_layer, attn, new_k, new_v, full_k, full_v = _batch(gen, query_lens, seq_lens, 4, 32, 2, 16, 0, dtype, "cpu")
    query = torch.randn(sum(query_lens), 4, 16, generator=gen).to(dtype)
    write_kv(kv_layer, new_k, new_v, attn.slot_mapping)
    out = paged_attention(query, kv_layer, attn, 0.25)
    assert out.dtype == dtype
    full_k = [k.to(dtype).double() for k in full_k]  # the reference sees the same rounded inputs
    full_v = [v.to(dtype).double() for v in full_v]
    torch.testing.assert_close(out.double(), _reference(query, full_k, full_v, query_lens, 0.25, None),
                               atol=tol, rtol=tol)


def test_write_kv_skips_padding_and_touches_only_its_slots():
    gen = torch.Generator().manual_seed(12)
    kv_layer = torch.randn(2, 8, 4, 2, 8, generator=gen)
    before = kv_layer.clone()
    key, value = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([-1, 5, 0, -1, 31, -1])  # slot 0 is both a real target and the clamp target
    write_kv(kv_layer, key, value, slots)
    flat, flat_before = kv_layer.view(2, 32, 2, 8), before.view(2, 32, 2, 8)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[0, s], key[t]) and torch.equal(flat[1, s], value[t])
    untouched = [s for s in range(32) if s not in (0, 5, 31)]
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_write_kv_all_padding_leaves_cache_unchanged():
    kv_layer = torch.randn(2, 4, 4, 1, 8)
    before = kv_layer.clone()
    write_kv(kv_layer, torch.randn(3, 1, 8), torch.randn(3, 1, 8), torch.full((3,), -1))
    assert torch.equal(kv_layer, before)


def test_token_seq_lens_maps_tokens_to_their_sequence():
    attn = AttentionMetadata(slot_mapping=torch.zeros(7, dtype=torch.long),
                             query_start_loc=torch.tensor([0, 1, 5, 6], dtype=torch.int32),
                             seq_lens=torch.tensor([9, 4, 20], dtype=torch.int32),
                             block_tables=torch.zeros(3, 5, dtype=torch.int32), max_query_len=4, max_seq_len=20)
    assert token_seq_lens(attn, 7).tolist() == [9, 4, 4, 4, 4, 20, 0]  # last token: padding


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """write_kv + paged_attention capture in a CUDA graph (fixed shapes) and replay with new data."""
    gen = torch.Generator().manual_seed(13)
    query_lens, seq_lens = [1, 1, 1], [5, 17, 9]
    kv_layer, attn, new_k, new_v, full_k, full_v = _batch(gen, query_lens, seq_lens, 4, 64, 2, 16, 1,
                                                          torch.float32, "cuda")
    query = torch.randn(4, 4, 16, generator=gen).cuda()
    static = (query.clone(), new_k.clone(), new_v.clone())

    def run():
        write_kv(kv_layer, static[1], static[2], attn.slot_mapping)
        return paged_attention(static[0], kv_layer, attn, 0.25)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    fresh_q = torch.randn(4, 4, 16, generator=gen).cuda()
    static[0].copy_(fresh_q)
    graph.replay()
    torch.cuda.synchronize()
    expected = _reference(fresh_q.cpu(), full_k, full_v, query_lens, 0.25, None)
    torch.testing.assert_close(out[:-1].double().cpu(), expected, atol=1e-4, rtol=1e-4)
