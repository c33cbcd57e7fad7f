"""Triton paged attention (lora_runner/model/paged_attention.py) against float64 and the torch path.

CPU tensors run the kernels' interpreted twins (no TRITON_INTERPRET needed, as in
test_kernels_triton.py), in fp32 and fp16; gpu-marked tests run the compiled kernels in bf16 and
replay a captured CUDA graph across context lengths. Every case: K/V in shuffled blocks of a
NaN-filled cache, block-table entries past a sequence's blocks pointing at NaN blocks, outputs
NaN-poisoned before the call. The grid covers each axis at least once (head_dim 64/128, GQA 1/4/8,
block size 16/32, contexts 1..2048, split counts 1/3/auto/16, windows) without its full product:
the interpreter is slow.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from lora_runner.model import attention  # noqa: E402
from lora_runner.model import paged_attention as kernels  # noqa: E402
from lora_runner.model.attention import paged_attention, write_kv  # noqa: E402
from lora_runner.model.forward_context import AttentionMetadata  # noqa: E402

NAN = float("nan")
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@dataclass
class Case:
    """A flat batch whose whole context (cached + this step's tokens) is already in the cache."""

    kv_layer: torch.Tensor  # [2, num_blocks, bs, H_kv, D]
    attn: AttentionMetadata
    query: torch.Tensor  # [T + padding, H, D]
    full_k: list[torch.Tensor]  # per sequence [L_b, H_kv, D] float64 (values as stored)
    full_v: list[torch.Tensor]
    query_lens: list[int]

    @property
    def num_real(self) -> int:
        return sum(self.query_lens)


def make_case(seed, query_lens, seq_lens, block_size, heads, head_dim, dtype, num_padding=0, device="cpu") -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(needed) + 6
    kv_layer = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), NAN, dtype=dtype)
    # block 0 stays NaN: kernels that read masked positions through block 0 (a masked table load) must not use them
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table_width = max(needed) + 2
    block_tables = torch.empty(len(seq_lens), table_width, dtype=torch.int32)
    full_k, full_v = [], []
    flat = kv_layer.view(2, -1, num_kv_heads, head_dim)
    for b, (length, n) in enumerate(zip(seq_lens, needed)):
        table = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int64)
        block_tables[b, :n] = table
        pos = torch.arange(length)
        slots = table[pos // block_size] * block_size + pos % block_size
        kv = torch.randn(2, length, num_kv_heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
        flat[:, slots] = kv
        full_k.append(kv[0].double())
        full_v.append(kv[1].double())
    block_tables[:, :] = torch.where(torch.arange(table_width) < torch.tensor(needed)[:, None], block_tables,
                                     torch.tensor(free[:1] or [0], dtype=torch.int32))  # stale entries: a NaN block
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    num_tokens = sum(query_lens) + num_padding
    attn = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),  # K/V already written
        query_start_loc=starts.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device), max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    return Case(kv_layer.to(device), attn, query.to(device), full_k, full_v, list(query_lens))


def float64_attention(case: Case, scale: float, window: int | None) -> torch.Tensor:
    """[real tokens, H, D] float64: each new token over its own context, causal, within the window."""
    outs, row = [], 0
    for k, v, qlen in zip(case.full_k, case.full_v, case.query_lens):
        length, num_kv_heads = k.shape[:2]
        q = case.query[row:row + qlen].double().cpu()  # [qlen, H, D]
        group = q.shape[1] // num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [L, H, D]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [H, qlen, L]
        q_pos = torch.arange(length - qlen, length)[:, None]
        k_pos = torch.arange(length)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        outs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), v))
        row += qlen
    return torch.cat(outs)


def check(out: torch.Tensor, case: Case, scale: float, window: int | None) -> None:
    """Real rows: finite, close to float64 and to the torch path; padding rows: zero."""
    n, tol = case.num_real, TOLERANCE[case.query.dtype]
    real = out[:n].double().cpu()
    assert torch.isfinite(real).all(), "NaN from a stale block or an unwritten row"
    torch.testing.assert_close(real, float64_attention(case, scale, window), atol=tol, rtol=tol)
    torch_path = paged_attention(case.query, case.kv_layer, case.attn, scale, window, backend="torch")
    torch.testing.assert_close(real, torch_path[:n].double().cpu(), atol=tol, rtol=tol)
    assert (out[n:] == 0).all(), "padding tokens get zeros"


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


# ----------------------------------------------------------------------------- decode (interpreter)

DECODE_CASES = {  # id: (head_dim, (H, H_kv), block_size, dtype, seq_lens, window, num_splits)
    "mha-d64-bs16-fp32-auto": (64, (4, 4), 16, torch.float32, [1, 17, 300, 2048], None, None),
    "gqa4-d128-bs32-fp16-nosplit": (128, (8, 2), 32, torch.float16, [2048, 1, 64, 1000], None, 1),
    "gqa8-d128-bs16-fp32-split16-window": (128, (8, 1), 16, torch.float32, [2047, 5, 700], 300, 16),
    "gqa4-d64-bs32-fp16-split3-window": (64, (8, 2), 32, torch.float16, [33, 1500, 1], 64, 3),
    "gqa8-d64-bs16-fp16-auto": (64, (16, 2), 16, torch.float16, [1, 2, 31, 32, 33, 511, 1024], None, None),
}


@pytest.mark.parametrize("name", sorted(DECODE_CASES))
def test_decode_matches_float64_and_torch_path(name):
    head_dim, heads, block_size, dtype, seq_lens, window, num_splits = DECODE_CASES[name]
    case = make_case(seed_of(name), [1] * len(seq_lens), seq_lens, block_size, heads, head_dim, dtype)
    out = torch.full_like(case.query, NAN)
    scale = head_dim ** -0.5
    kernels.decode_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens, scale,
                             window, num_splits=num_splits, out=out)
    check(out, case, scale, window)


def test_decode_one_launch_serves_every_context_length():
    """What a CUDA graph replays: the same launch (same shapes, same split count) after seq_lens and
    block tables change in place, from 1 token to the table's capacity."""
    lengths = [[1, 2048], [16, 17], [2000, 1], [129, 640]]
    first = make_case(3, [1, 1], lengths[0], 16, (8, 2), 64, torch.float32)
    out = torch.empty_like(first.query)
    for step, seq_lens in enumerate(lengths):
        case = make_case(100 + step, [1, 1], seq_lens, 16, (8, 2), 64, torch.float32)
        width = min(case.attn.block_tables.shape[1], first.attn.block_tables.shape[1])
        first.attn.block_tables.fill_(0)
        first.attn.block_tables[:, :width] = case.attn.block_tables[:, :width]  # in place, like the builder
        first.attn.seq_lens.copy_(case.attn.seq_lens)
        first.query.copy_(case.query)
        first.kv_layer[:, :case.kv_layer.shape[1]] = case.kv_layer  # same cache tensor, new contents
        kernels.decode_attention(first.query, first.kv_layer, first.attn.block_tables, first.attn.seq_lens,
                                 0.125, num_splits=4, out=out.fill_(NAN))
        torch.testing.assert_close(out.double(), float64_attention(case, 0.125, None), atol=2e-5, rtol=2e-5)


def test_decode_empty_sequence_gets_zeros():
    case = make_case(5, [1, 1], [40, 1], 16, (4, 2), 64, torch.float32)
    case.attn.seq_lens[1] = 0
    for num_splits in (1, 2):
        out = kernels.decode_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens,
                                       0.125, num_splits=num_splits)
        assert (out[1] == 0).all() and torch.isfinite(out[0]).all()


def test_split_count_depends_on_batch_and_capacity_only():
    assert kernels.decode_num_splits(1, 8, 4096) == kernels.MAX_SPLITS
    assert kernels.decode_num_splits(256, 8, 4096) == 1  # enough programs without splitting
    assert kernels.decode_num_splits(1, 8, 300) == 1  # too short a table to split
    for batch in (1, 3, 8, 32, 128):
        splits = kernels.decode_num_splits(batch, 8, 2048)
        assert splits & (splits - 1) == 0 and 1 <= splits <= kernels.MAX_SPLITS


# ----------------------------------------------------------------------------- prefill (interpreter)

PREFILL_CASES = {  # id: (head_dim, (H, H_kv), block_size, dtype, query_lens, seq_lens, window, padding)
    "mha-d64-bs16-fp32-mixed": (64, (4, 4), 16, torch.float32, [5, 70, 1], [5, 200, 33], None, 3),
    "gqa4-d128-bs32-fp16-prefix": (128, (8, 2), 32, torch.float16, [130, 16, 1], [2048, 130, 900], None, 2),
    "gqa8-d128-bs16-fp32-window": (128, (8, 1), 16, torch.float32, [100, 7, 64], [612, 7, 64], 48, 1),
    "gqa4-d64-bs32-fp16-window": (64, (8, 2), 32, torch.float16, [65, 1], [1500, 300], 256, 0),
}


@pytest.mark.parametrize("name", sorted(PREFILL_CASES))
def test_prefill_chunks_match_float64_and_torch_path(name):
    head_dim, heads, block_size, dtype, query_lens, seq_lens, window, padding = PREFILL_CASES[name]
    case = make_case(seed_of(name), query_lens, seq_lens, block_size, heads, head_dim, dtype, padding)
    out = torch.full_like(case.query, NAN)
    scale = head_dim ** -0.5
    kernels.prefill_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens,
                              case.attn.query_start_loc, case.attn.max_query_len, scale, window, out=out)
    check(out, case, scale, window)


def test_chunked_prefill_equals_whole_prompt():
    """A prompt run as three chunks over its growing paged prefix gives the whole-prompt rows."""
    case = make_case(9, [300], [300], 16, (8, 2), 64, torch.float32)
    whole = kernels.prefill_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens,
                                      case.attn.query_start_loc, 300, 0.125, 100)
    for start, end in ((0, 64), (64, 65), (65, 300)):
        chunk = kernels.prefill_attention(
            case.query[start:end], case.kv_layer, case.attn.block_tables,
            torch.tensor([end], dtype=torch.int32), torch.tensor([0, end - start], dtype=torch.int32),
            end - start, 0.125, 100)
        torch.testing.assert_close(chunk, whole[start:end], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- dispatch in attention.py


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_attention_dispatches_to_triton_kernels(kind):
    """paged_attention(backend="triton") after write_kv equals the torch path: decode steps (graph
    padding as extra length-1 sequences) and mixed steps (padding tokens)."""
    if kind == "decode":
        query_lens, seq_lens, padding = [1, 1, 1, 1], [9, 1, 130, 1], 0
    else:
        query_lens, seq_lens, padding = [1, 20, 5], [40, 20, 77], 2
    case = make_case(seed_of(kind), query_lens, seq_lens, 16, (4, 1), 64, torch.float32, padding)
    new_k = torch.cat([k[-q:] for k, q in zip(case.full_k, query_lens)] + [torch.zeros(padding, 1, 64)]).float()
    new_v = torch.cat([v[-q:] for v, q in zip(case.full_v, query_lens)] + [torch.zeros(padding, 1, 64)]).float()
    flat = case.kv_layer.view(2, -1, 1, 64)
    slots = []
    for b, (q, length) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(length - q, length)
        slots.append(case.attn.block_tables[b, pos // 16].long() * 16 + pos % 16)
    case.attn.slot_mapping = torch.cat(slots + [torch.full((padding,), -1)])
    flat[:, case.attn.slot_mapping[:case.num_real]] = NAN  # write_kv must fill them back
    write_kv(case.kv_layer, new_k, new_v, case.attn.slot_mapping)
    out = paged_attention(case.query, case.kv_layer, case.attn, 0.125, backend="triton")
    check(out, case, 0.125, None)


def test_backend_resolution(monkeypatch):
    cpu_query = torch.zeros(1, 1, 16)
    assert attention.resolve_backend("auto", cpu_query) == "torch"  # the CPU keeps the torch path
    assert attention.resolve_backend("triton", cpu_query) == "triton"
    monkeypatch.setenv(attention.BACKEND_ENV, "torch")
    assert attention.resolve_backend(None, cpu_query) == "torch"
    with pytest.raises(ValueError, match="attention backend"):
        attention.resolve_backend("flash", cpu_query)


def test_bad_arguments_raise_value_error():
    case = make_case(1, [1], [10], 16, (4, 2), 64, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        kernels.decode_attention(case.query[:, :3], case.kv_layer, case.attn.block_tables, case.attn.seq_lens, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernels.decode_attention(case.query.half(), case.kv_layer, case.attn.block_tables, case.attn.seq_lens, 1.0)


# ----------------------------------------------------------------------------- compiled kernels (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, None])
def test_gpu_decode_bf16_matches_torch_path(num_splits):
    case = make_case(21, [1] * 6, [1, 15, 16, 1000, 4095, 4096], 16, (32, 8), 128, torch.bfloat16, device="cuda")
    out = kernels.decode_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens,
                                   128 ** -0.5, num_splits=num_splits, out=torch.full_like(case.query, NAN))
    check(out, case, 128 ** -0.5, None)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 256])
def test_gpu_prefill_bf16_matches_torch_path(window):
    case = make_case(22, [300, 1, 64], [2000, 77, 64], 32, (32, 8), 128, torch.bfloat16, 3, device="cuda")
    out = kernels.prefill_attention(case.query, case.kv_layer, case.attn.block_tables, case.attn.seq_lens,
                                    case.attn.query_start_loc, case.attn.max_query_len, 128 ** -0.5, window,
                                    out=torch.full_like(case.query, NAN))
    check(out, case, 128 ** -0.5, window)


@pytest.mark.gpu
def test_gpu_one_decode_graph_replays_every_context_length():
    """Capture paged_attention's decode path once; replaying after rewriting seq_lens, tables and the
    cache in place equals eager attention for contexts from 1 to the table's capacity."""
    capacity_blocks, block_size, batch = 128, 16, 4
    static = make_case(30, [1] * batch, [capacity_blocks * block_size] * batch, block_size, (32, 8), 128,
                       torch.bfloat16, device="cuda")
    static.attn.block_tables = static.attn.block_tables[:, :capacity_blocks].contiguous()

    def run():
        return paged_attention(static.query, static.kv_layer, static.attn, 128 ** -0.5, backend="triton")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step, seq_lens in enumerate(([1, 2, 3, 4], [2048, 17, 1, 700], [33, 1999, 64, 2048])):
        case = make_case(40 + step, [1] * batch, seq_lens, block_size, (32, 8), 128, torch.bfloat16, device="cuda")
        width = min(case.attn.block_tables.shape[1], capacity_blocks)
        static.attn.block_tables.zero_()
        static.attn.block_tables[:, :width] = case.attn.block_tables[:, :width]
        static.attn.seq_lens.copy_(case.attn.seq_lens)
        static.query.copy_(case.query)
        static.kv_layer[:, :case.kv_layer.shape[1]] = case.kv_layer
        graph.replay()
        torch.cuda.synchronize()
        check(out, case, 128 ** -0.5, None)


def test_gpu_check_attention_section_on_cpu():
    """benchmarks/gpu_check.py's attention section at its CPU-smoke sizes (interpreter): rows for every
    batch x context plus the prefill point, Triton within fp32 rounding of the torch path."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import gpu_check

    results = {}
    gpu_check.run_attention(gpu_check.CPU_SMOKE, results, deadline=float("inf"))
    rows = results["attention"]
    cfg = gpu_check.CPU_SMOKE.attention
    assert [(r["kind"], r["batch"], r["context"]) for r in rows] == [
        *[("decode", b, c) for b in cfg["batches"] for c in cfg["contexts"]],
        ("prefill", cfg["prefill"][0], max(cfg["contexts"]))]
    assert all(r["max_abs_diff"] < 1e-5 for r in rows), rows
    assert len(gpu_check.attention_table(results)) == 2 + len(rows)
