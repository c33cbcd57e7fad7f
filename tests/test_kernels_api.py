"""LoRAMeta tables and invariants, argument validation, and backend dispatch."""

from __future__ import annotations

import pytest
import torch

import punica_kernels.ops as ops
from punica_kernels import (BackendUnavailableError, LoRAMeta, TableLoader, add_lora, load_table, lora_expand,
                            lora_shrink)
from test_kernels_reference import POPULARITY, make_case, naive_add_lora, token_slots_for


@pytest.mark.parametrize("block_m", [16, 32])
def test_loaded_tables_hold_sorted_segments_and_tiles(block_m):
    """Across many tables loaded into one meta: stable sort, slot starts, tiles that cover each slot once."""
    gen = torch.Generator().manual_seed(block_m)
    meta = LoRAMeta(200, 6, "cpu", block_m=block_m)
    tables = TableLoader(meta)
    for step in range(24):
        num_tokens = int(torch.randint(1, 201, (1,), generator=gen))
        slots = token_slots_for(POPULARITY[step % len(POPULARITY)], num_tokens, 6, gen)
        tables.load(slots.to(torch.int32 if step % 2 else torch.int64))
        assert meta.num_tokens == num_tokens
        order = meta.sorted_tokens[:num_tokens]
        keys = torch.where(slots < 0, 6, slots)
        assert torch.equal(order, torch.sort(keys, stable=True).indices)
        starts = meta.slot_starts.tolist()
        assert starts == [int((keys < s).sum()) for s in range(8)]

        covered = []
        for tile in range(meta.max_tile_count):
            slot, start, end = (int(meta.tile_slots[tile]), int(meta.tile_starts[tile]),
                                int(meta.tile_ends[tile]))
            if slot < 0:
                continue
            assert tile < meta.max_tiles(num_tokens), "a tile with work lies outside the grid"
            assert 0 < end - start <= block_m and starts[slot] <= start and end <= starts[slot + 1]
            covered.extend(order[start:end].tolist())
            assert (slots[order[start:end]] == slot).all()
        assert sorted(covered) == sorted(torch.nonzero(slots >= 0).flatten().tolist())


def test_max_tiles_depends_on_token_count_only():
    meta = LoRAMeta(1024, 32, "cpu")
    assert meta.max_tiles(0) == 0
    assert meta.max_tiles(1) == 2
    assert meta.max_tiles(1024) == 64 + 32 == meta.max_tile_count


def test_lora_shrink_allocates_out_when_not_given():
    case = make_case(9, "qkv", 4, "uniform", dtype=torch.float64)
    meta = LoRAMeta(9, 8, "cpu")
    load_table(meta, case.token_slots)
    inter = lora_shrink(case.x, case.lora_a, meta)
    assert inter.shape == (9, 3, 4) and inter.dtype == torch.float64
    y = case.y.clone()
    lora_expand(y, inter, case.lora_b, meta, list(case.slice_sizes))
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)


def test_auto_and_torch_work_without_triton(monkeypatch):
    monkeypatch.setattr(ops, "triton_ops", None)
    monkeypatch.setattr(ops, "_TRITON_IMPORT_ERROR", ImportError("No module named 'triton'"))
    case = make_case(5, "o", 4, "uniform", dtype=torch.float64)
    meta = LoRAMeta(5, 8, "cpu")
    load_table(meta, case.token_slots)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, backend="auto")
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    with pytest.raises(BackendUnavailableError, match="triton"):
        add_lora(y.float(), case.x.float(), case.lora_a.float(), case.lora_b.float(), meta,
                 case.slice_sizes, backend="triton")


@pytest.fixture
def setup():
    case = make_case(6, "qkv", 4, "mixed_none", seed=1)
    meta = LoRAMeta(8, 8, "cpu")
    load_table(meta, case.token_slots)
    return case, meta


BAD_ADD_LORA = {
    "x 1-D": lambda c: dict(x=c.x[0]),
    "x rows != prepared T": lambda c: dict(x=c.x[:5]),
    "x integer": lambda c: dict(x=c.x.long()),
    "lora_a K mismatch": lambda c: dict(lora_a=c.lora_a[..., :64]),
    "lora_a max_loras mismatch": lambda c: dict(lora_a=c.lora_a[:4]),
    "lora_a slice count": lambda c: dict(lora_a=c.lora_a[:, :2]),
    "lora_a dtype": lambda c: dict(lora_a=c.lora_a.half()),
    "lora_b rank mismatch": lambda c: dict(lora_b=c.lora_b[..., :2]),
    "lora_b N mismatch": lambda c: dict(lora_b=c.lora_b[:, :100]),
    "y dtype": lambda c: dict(y=c.y.double()),
    "y N != sum(slices)": lambda c: dict(slice_sizes=(128, 32, 16)),
    "empty slice_sizes": lambda c: dict(slice_sizes=()),
    "negative slice": lambda c: dict(slice_sizes=(160, 64, -32)),
    "bad backend": lambda c: dict(backend="cuda"),
    "triton float64": lambda c: dict(x=c.x.double(), y=c.y.double(), lora_a=c.lora_a.double(),
                                     lora_b=c.lora_b.double(), backend="triton"),
    "interpreter bf16": lambda c: dict(x=c.x.bfloat16(), y=c.y.bfloat16(),
                                       lora_a=c.lora_a.bfloat16(), lora_b=c.lora_b.bfloat16(),
                                       backend="triton"),
}


@pytest.mark.parametrize("name", list(BAD_ADD_LORA))
def test_add_lora_rejects_bad_arguments(setup, name):
    case, meta = setup
    args = dict(y=case.y.clone(), x=case.x, lora_a=case.lora_a, lora_b=case.lora_b, meta=meta,
                slice_sizes=case.slice_sizes, backend="torch")
    args.update(BAD_ADD_LORA[name](case))
    backend = args.pop("backend")
    with pytest.raises(ValueError):
        add_lora(**args, backend=backend)


def test_halves_reject_bad_intermediate(setup):
    case, meta = setup
    with pytest.raises(ValueError, match="inter"):
        lora_shrink(case.x, case.lora_a, meta, torch.empty(6, 3, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="inter"):
        lora_shrink(case.x, case.lora_a, meta, torch.empty(6, 2, 4))
    with pytest.raises(ValueError, match="R=5"):  # inter's rank disagrees with lora_b's
        lora_expand(case.y.clone(), torch.empty(6, 3, 5), case.lora_b, meta, case.slice_sizes)
    with pytest.raises(ValueError, match="inter"):
        lora_expand(case.y.clone(), torch.empty(6, 12), case.lora_b, meta, case.slice_sizes)
    with pytest.raises(ValueError, match="y must be float"):
        lora_expand(case.y.long(), torch.empty(6, 3, 4), case.lora_b, meta, case.slice_sizes)


def test_meta_without_a_table_is_refused():
    case = make_case(3, "o", 4, "uniform")
    with pytest.raises(ValueError, match="no table"):
        add_lora(case.y, case.x, case.lora_a, case.lora_b, LoRAMeta(4, 8, "cpu"), case.slice_sizes)


@pytest.mark.parametrize("token_slots,slot_ranks,match", [
    (torch.zeros(9, dtype=torch.int64), None, "max_num_tokens"),
    (torch.tensor([0, 4]), None, r"\[-1, 4\)"),
    (torch.tensor([0, -2]), None, r"\[-1, 4\)"),
    (torch.tensor([0.0, 1.0]), None, "integer"),
    (torch.zeros(2, 1, dtype=torch.int64), None, "1-D"),
    (torch.tensor([0, 1]), torch.tensor([8, 8, 8]), "max_loras"),
    (torch.tensor([0, 1]), torch.tensor([8, 8, -1, 8]), ">= 0"),
    (torch.tensor([0, 1]), torch.tensor([8.0, 8.0, 8.0, 8.0]), "integer"),
])
def test_table_load_rejects_bad_arguments(token_slots, slot_ranks, match):
    with pytest.raises(ValueError, match=match):
        load_table(LoRAMeta(8, 4, "cpu"), token_slots, slot_ranks)


def test_meta_rejects_bad_sizes():
    with pytest.raises(ValueError):
        LoRAMeta(0, 4, "cpu")
    with pytest.raises(ValueError):
        LoRAMeta(8, 0, "cpu")
    with pytest.raises(ValueError, match="block_m"):
        LoRAMeta(8, 4, "cpu", block_m=24)


def test_unchecked_out_of_range_slots_are_treated_as_none():
    """check=False never reads out of bounds: bad slots get no LoRA."""
    case = make_case(4, "o", 4, "uniform", dtype=torch.float64)
    case.token_slots = torch.tensor([0, 99, -5, 1])
    meta = LoRAMeta(4, 8, "cpu")
    load_table(meta, case.token_slots, check=False)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)
    case.token_slots = torch.tensor([0, -1, -1, 1])
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
