"""Triton SGMV kernels under the interpreter (CPU tensors, fp32/fp16) against the float64 oracle.

The oracle is the torch path in float64 (itself checked against a per-token loop in
test_kernels_reference.py). Scratch and outputs are NaN-poisoned before each call; y is updated
in place and its slot -1 rows must stay bit-identical.
"""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton")

from punica_kernels import LoRAMeta, TableLoader, add_lora, load_table, lora_expand, lora_shrink  # noqa: E402
from punica_kernels import triton_ops  # noqa: E402
from test_kernels_reference import (LAYOUTS, POPULARITY, float64_add_lora,  # noqa: E402
                                    make_case, prepared_meta, token_slots_for)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}
NAN = float("nan")


def oracle(case, meta: LoRAMeta) -> torch.Tensor:
    return float64_add_lora(case.y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)


def poisoned_meta(case, with_ranks: bool, **kwargs) -> LoRAMeta:
    """A prepared meta whose preallocated workspace is full of NaN.

    Sized for 512 tokens like an engine's, so small batches get K-split partials.
    """
    _, n_slices, max_rank, _ = case.lora_a.shape
    meta = prepared_meta(case, 512, with_ranks=with_ranks, max_rank=max_rank,
                         max_slices=n_slices, **kwargs)
    meta.workspace.fill_(NAN)
    return meta


def check_add_lora(case, with_ranks: bool, **meta_kwargs) -> None:
    meta = poisoned_meta(case, with_ranks, **meta_kwargs)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="triton")
    tol = TOLERANCE[case.x.dtype]
    torch.testing.assert_close(y.double(), oracle(case, meta), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])  # bit-identical, not merely close


GRID_LAYOUT = {1: "qkv_wide", 7: "down_wide", 64: "qkv", 300: "gate_up"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 300])
def test_add_lora_tokens_by_popularity(num_tokens, popularity, dtype):
    case = make_case(num_tokens, GRID_LAYOUT[num_tokens], 16, popularity, mixed_ranks=True,
                     seed=num_tokens * 7 + POPULARITY.index(popularity), dtype=dtype)
    check_add_lora(case, with_ranks=dtype == torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("rank", [1, 4, 8, 16, 64, "mixed"])
def test_add_lora_ranks_by_layout(rank, layout, dtype):
    mixed = rank == "mixed"
    case = make_case(20, layout, 64 if mixed else rank, "mixed_none", mixed_ranks=mixed,
                     seed=len(layout) + (0 if mixed else rank), dtype=dtype)
    check_add_lora(case, with_ranks=mixed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_wide_stacked_rank_uses_smaller_k_step(dtype):
    """3 slices x rank 128 stack to 384 rows of A (a 512-row tile, BLOCK_K halved)."""
    case = make_case(20, "qkv", 128, "uniform", mixed_ranks=True, seed=12, dtype=dtype)
    check_add_lora(case, with_ranks=True)


def test_slot_ranks_skip_padding_beyond_rank_rounded_to_16():
    case = make_case(48, "qkv", 64, "uniform", mixed_ranks=True, seed=11)
    meta = poisoned_meta(case, with_ranks=True)
    expected = oracle(case, meta)  # zero padding
    # Poison the padding the kernels must not read: ranks rounded up to 16, beyond that NaN.
    read = (torch.arange(64)[None, :] < (case.slot_ranks[:, None] + 15) // 16 * 16)  # [L, R]
    lora_a = case.lora_a.masked_fill(~read[:, None, :, None], NAN)
    lora_b = case.lora_b.masked_fill(~read[:, None, :], NAN)
    y = case.y.clone()
    add_lora(y, case.x, lora_a, lora_b, meta, case.slice_sizes, backend="triton")
    torch.testing.assert_close(y.double(), expected, rtol=2e-5, atol=2e-5)
    # The shrink alone: skipped rank rows come out as exact zeros, read rows as x @ A.T.
    inter = lora_shrink(case.x, lora_a, meta, backend="triton")  # [T, 3, 64]
    expected_inter = lora_shrink(case.x.double(), case.lora_a.double(), meta, backend="torch")
    torch.testing.assert_close(inter.double(), expected_inter, rtol=2e-5, atol=2e-5)
    skipped = ~read[case.token_slots]  # [T, R]
    assert (inter.permute(0, 2, 1)[skipped] == 0).all()


def test_shrink_and_expand_halves():
    case = make_case(37, "qkv", 8, "mixed_none", seed=4)
    meta = prepared_meta(case)
    lora_rows = case.token_slots >= 0
    inter = torch.full((37, 3, 8), NAN)  # poisoned output
    lora_shrink(case.x, case.lora_a, meta, inter, backend="triton")
    expected = lora_shrink(case.x.double(), case.lora_a.double(), meta, backend="torch")
    torch.testing.assert_close(inter[lora_rows].double(), expected[lora_rows], rtol=2e-5, atol=2e-5)
    assert inter[~lora_rows].isnan().all()  # documented: slot -1 rows are not written

    inter = inter.nan_to_num(0.0)  # fresh intermediate, any values in the -1 rows
    y = case.y.clone()
    lora_expand(y, inter, case.lora_b, meta, case.slice_sizes, backend="triton")
    y64 = case.y.double().clone()
    lora_expand(y64, inter.double(), case.lora_b.double(), meta, case.slice_sizes, backend="torch")
    torch.testing.assert_close(y.double(), y64, rtol=2e-5, atol=2e-5)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


def test_one_meta_reused_across_steps():
    """Fixed buffers: many tables loaded into the same buffers, with different T, mixes and ranks, all
    give right results."""
    gen = torch.Generator().manual_seed(0)
    meta = LoRAMeta(300, 8, "cpu", max_rank=16, max_slices=3)
    tables = TableLoader(meta)
    base = make_case(300, "qkv", 16, "uniform", mixed_ranks=True, seed=1)
    steps = [(300, "uniform"), (1, "identical"), (64, "distinct"), (7, "all_none"),
             (150, "skewed"), (3, "mixed_none"), (300, "mixed_none")]
    for step, (num_tokens, popularity) in enumerate(steps):
        slots = token_slots_for(popularity, num_tokens, 8, gen)
        ranks = base.slot_ranks if step % 2 else None
        tables.load(slots, ranks)
        meta.workspace.fill_(NAN)
        x, y0 = base.x[:num_tokens], torch.randn(num_tokens, 192, generator=gen)
        y = y0.clone()
        add_lora(y, x, base.lora_a, base.lora_b, meta, base.slice_sizes, backend="triton")
        expected = float64_add_lora(y0, x, base.lora_a, base.lora_b, meta, base.slice_sizes)
        torch.testing.assert_close(y.double(), expected, rtol=2e-5, atol=2e-5)
        assert torch.equal(y[slots < 0], y0[slots < 0])


def test_strided_inputs_and_output_view():
    """x and y as views into larger tensors (e.g. y a column range of a fused output)."""
    case = make_case(25, "gate_up", 8, "uniform", seed=6)
    meta = prepared_meta(case)
    x_store = torch.randn(96, 25).T  # [25, 96] column-major storage
    x_store.copy_(case.x)
    out_store = torch.randn(25, 200)
    y = out_store[:, 20:180]  # [25, 160] view
    y.copy_(case.y)
    before = out_store.clone()
    add_lora(y, x_store, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="triton")
    torch.testing.assert_close(y.double(), oracle(case, meta), rtol=2e-5, atol=2e-5)
    assert torch.equal(out_store[:, :20], before[:, :20])
    assert torch.equal(out_store[:, 180:], before[:, 180:])


def test_deterministic_bitwise():
    case = make_case(64, "down_wide", 16, "skewed", seed=8)
    results = []
    for _ in range(2):
        y = case.y.clone()
        add_lora(y, case.x, case.lora_a, case.lora_b, poisoned_meta(case, True), case.slice_sizes,
                 backend="triton")
        results.append(y)
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("room,split", [(1, 1), (3, 3), (16, 4)])
def test_split_k_partials_fill_the_workspace_room(room, split):
    """T=2, K=512: up to 4 K-splits (chunks of MIN_K_PER_SPLIT), as many as the workspace has room for."""
    case = make_case(2, "down_wide", 8, "distinct", seed=2)
    meta = LoRAMeta(2, 8, "cpu")
    load_table(meta, case.token_slots)
    row_elements = 2 * 1 * 8  # T x n_slices x R
    workspace = meta.workspace_for(room * row_elements).fill_(NAN)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="triton")
    torch.testing.assert_close(y.double(), oracle(case, meta), rtol=2e-5, atol=2e-5)
    assert int(workspace.isfinite().sum()) == split * row_elements  # partials written, the first is the sum


def test_choose_split_k():
    assert triton_ops.choose_split_k(tile_programs=8, num_features=4096, max_split=100) == 32
    assert triton_ops.choose_split_k(tile_programs=8, num_features=11008, max_split=100) == 29  # 6 blocks each
    assert triton_ops.choose_split_k(tile_programs=1, num_features=128, max_split=100) == 1
    assert triton_ops.choose_split_k(tile_programs=8, num_features=4096, max_split=5) == 5
    assert triton_ops.choose_split_k(tile_programs=64, num_features=4096, max_split=100) == 4
    assert triton_ops.choose_split_k(tile_programs=544, num_features=4096, max_split=100) == 1
    for programs, features, room in itertools.product([1, 9, 70], [64, 100, 4096, 11008], [1, 2, 16, 100]):
        split = triton_ops.choose_split_k(programs, features, room)
        k_blocks = -(-features // triton_ops.BLOCK_K)
        per_split = -(-k_blocks // split)
        assert 1 <= split <= room and -(-k_blocks // per_split) == split  # every split has K to work on
        assert split == 1 or per_split * triton_ops.BLOCK_K >= triton_ops.MIN_K_PER_SPLIT


def test_empty_batch_is_a_no_op():
    case = make_case(0, "o", 8, "uniform")
    meta = LoRAMeta(4, 8, "cpu")
    load_table(meta, case.token_slots)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="triton")
    assert y.shape == (0, 64)
