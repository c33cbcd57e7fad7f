"""The SGMV kernels' grid, bytes and split-K reduction at decode (issue 26, items 2-3), without a GPU.

The grid and bytes tests trace the real add_lora launches of one decode step at the GPU run's shape
(kernel_tools.aot.decode_step: benchmarks/gpu_check.py's model, 32 sequences on 8 of 32 adapter
slots, after a real table load) and count, from the traced grids and the meta's tile table,
the programs that have work and the bytes they move. The reduction tests run the shrink under the
Triton interpreter with NaN-poisoned scratch. The PTX proofs (item 1) are in test_kernels_compile.py,
which compiles every config once.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_tools import aot  # noqa: E402
from punica_kernels import LoRAMeta, load_table, triton_ops  # noqa: E402
from test_kernels_reference import float64_add_lora, make_case  # noqa: E402

NAN = float("nan")


@pytest.fixture(scope="module")
def decode_32_on_8() -> list[aot.ModuleStep]:
    return aot.decode_step(num_tokens=32, num_adapters=8)


def test_decode_shrink_has_at_least_128_programs_with_work(decode_32_on_8):
    """32 sequences on 8 adapters: 8 tiles with work; K split into chunks fills the machine."""
    for step in decode_32_on_8:
        assert step.shrink.with_work >= 128, (step.packed, step.shrink.launch.grid, step.shrink.with_work)


def test_decode_expand_grid_is_at_most_twice_its_programs_with_work(decode_32_on_8):
    for step in decode_32_on_8:
        assert step.expand.programs <= 2 * step.expand.with_work, (step.packed, step.expand.launch.grid,
                                                                  step.expand.with_work)


def test_decode_step_moves_at_most_1_3x_the_ideal_bytes(decode_32_on_8):
    """Ideal: A and B of the 8 slots used, x read, y's LoRA rows read and written."""
    moved = sum(s.shrink.bytes_moved + s.expand.bytes_moved for s in decode_32_on_8)
    ideal = sum(s.ideal_bytes for s in decode_32_on_8)
    assert moved <= 1.3 * ideal, {s.packed: round(s.bytes_ratio, 3) for s in decode_32_on_8}
    assert all(s.bytes_ratio <= 1.3 for s in decode_32_on_8)


def test_decode_grids_do_not_depend_on_the_adapter_mix(decode_32_on_8):
    """The launch contract: a graph captured with one adapter replays with many (SGLang #28371)."""
    for mix in (1, 32):
        for step, other in zip(decode_32_on_8, aot.decode_step(num_tokens=32, num_adapters=mix)):
            assert step.shrink.launch.grid == other.shrink.launch.grid
            assert step.expand.launch.grid == other.expand.launch.grid
            assert step.shrink.launch.args["k_blocks_per_split"] == other.shrink.launch.args["k_blocks_per_split"]


def test_expand_indexes_each_slices_columns_without_padding(decode_32_on_8):
    """qkv at the GPU shape: q 4096 + k 1024 + v 1024 columns = 96 blocks of 64, not 3 x 64."""
    qkv = next(s for s in decode_32_on_8 if s.packed == "qkv")
    assert qkv.expand.launch.grid[1] == (4096 + 1024 + 1024) // triton_ops.BLOCK_N


def _split_case(num_tokens: int = 3, num_features: int = 1024):
    """A decode batch on distinct slots, K wide enough for 8 splits; deltas of order one."""
    gen = torch.Generator().manual_seed(5)
    case = make_case(num_tokens, "down_wide", 16, "distinct", seed=5)
    x = torch.randn(num_tokens, num_features, generator=gen)  # [T, K]
    lora_a = torch.randn(case.lora_a.shape[0], 1, 16, num_features, generator=gen) / num_features ** 0.5  # [L, 1, R, K]
    meta = LoRAMeta(num_tokens, case.lora_a.shape[0], "cpu")
    load_table(meta, case.token_slots)
    return case, x, lora_a, meta, gen


def test_split_shrink_sums_the_partials_in_split_order():
    """Deterministic reduction: the result is bit for bit the fp32 sum of the partials taken in split
    order, whichever split arrived last; the arrival counters are back to zero afterwards."""
    case, x, lora_a, meta, _ = _split_case()
    split_k = triton_ops.choose_split_k(triton_ops.tile_programs(meta, 3), 1024, 100)
    assert split_k == 8  # 1024 / MIN_K_PER_SPLIT
    partials = torch.full((split_k, 3, 1, 16), NAN)  # [S, T, 1, R] poisoned
    out = torch.full((3, 1, 16), NAN)
    triton_ops._launch_shrink(x, lora_a, meta, out, partials)
    total = torch.zeros(3, 1, 16)
    for partial in partials:
        total += partial
    rows = case.token_slots >= 0
    assert torch.equal(out[rows], total[rows])
    expected = torch.einsum("tk,trk->tr", x[rows].double(), lora_a[case.token_slots[rows], 0].double())
    torch.testing.assert_close(out[rows, 0].double(), expected, rtol=2e-5, atol=2e-5)
    assert not triton_ops.split_counters(meta).any()


def test_split_counters_reset_so_every_launch_reduces():
    """Two add_lora calls on one meta (a graph replayed twice): both reduce their own partials."""
    case, x, lora_a, meta, gen = _split_case()
    lora_b = torch.randn(case.lora_b.shape[0], 64, 16, generator=gen) / 4  # [L, N, R]
    meta.workspace_for(8 * 3 * 16)
    for step in range(2):
        meta.workspace.fill_(NAN)
        y0 = torch.randn(3, 64, generator=gen)
        y = triton_ops.add_lora(y0.clone(), x * (step + 1), lora_a, lora_b, meta, (64,))
        expected = float64_add_lora(y0, x * (step + 1), lora_a, lora_b, meta, (64,))
        torch.testing.assert_close(y.double(), expected, rtol=2e-5, atol=2e-5)
        assert not triton_ops.split_counters(meta).any()
