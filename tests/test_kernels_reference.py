"""The torch LoRA path (CPU serving path and float64 oracle) against a per-token float64 loop.

Also home of the kernel-test case builders that the Triton and GPU tests import.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from punica_kernels import LoRAMeta, add_lora, load_table, lora_expand, lora_shrink, reference

POPULARITY = ("distinct", "uniform", "skewed", "identical", "all_none", "mixed_none")
# name -> (K, slice_sizes): 1-3 slices, unequal widths (q,k,v under GQA), widths not multiples of 64
LAYOUTS = {
    "o": (64, (64,)),
    "qkv": (128, (128, 32, 32)),
    "gate_up": (96, (80, 80)),
    "down_wide": (512, (200,)),
    "qkv_wide": (256, (512, 64, 64)),
}


def token_slots_for(popularity: str, num_tokens: int, max_loras: int,
                    gen: torch.Generator) -> torch.Tensor:
    """[T] int64 slot per token for an adapter-popularity pattern (-1 = no adapter)."""
    if popularity == "distinct":  # as many different adapters as possible, shuffled
        slots = torch.arange(num_tokens) % max_loras
        return slots[torch.randperm(num_tokens, generator=gen)]
    if popularity == "uniform":
        return torch.randint(0, max_loras, (num_tokens,), generator=gen)
    if popularity == "skewed":  # zipf-like: slot i drawn with probability ~ 1/(i+1)^2
        weights = 1.0 / torch.arange(1, max_loras + 1, dtype=torch.float64) ** 2
        return torch.multinomial(weights, num_tokens, replacement=True, generator=gen)
    if popularity == "identical":
        return torch.full((num_tokens,), int(torch.randint(0, max_loras, (1,), generator=gen)))
    if popularity == "all_none":
        return torch.full((num_tokens,), -1)
    if popularity == "mixed_none":
        slots = torch.randint(0, max_loras, (num_tokens,), generator=gen)
        return torch.where(torch.rand(num_tokens, generator=gen) < 0.4, -1, slots)
    raise ValueError(popularity)


@dataclass
class Case:
    """Inputs of one add_lora call; weights are zero beyond each slot's real rank."""

    x: torch.Tensor  # [T, K]
    y: torch.Tensor  # [T, N]
    lora_a: torch.Tensor  # [L, n, R, K]
    lora_b: torch.Tensor  # [L, N, R]
    token_slots: torch.Tensor  # [T] int64
    slot_ranks: torch.Tensor  # [L] int32
    slice_sizes: tuple[int, ...]

    def to(self, dtype: torch.dtype, device="cpu") -> Case:
        cast = {name: getattr(self, name).to(device=device, dtype=dtype)
                for name in ("x", "y", "lora_a", "lora_b")}
        return Case(**cast, token_slots=self.token_slots.to(device),
                    slot_ranks=self.slot_ranks.to(device), slice_sizes=self.slice_sizes)


def make_case(num_tokens: int, layout: str, max_rank: int, popularity: str, *, max_loras: int = 8,
              mixed_ranks: bool = False, seed: int = 0, dtype=torch.float32) -> Case:
    """Fresh random inputs (float64 draws rounded to ``dtype``), deltas of order one.

    mixed_ranks: each slot gets its own real rank in 1..max_rank (zero padding beyond it).
    """
    gen = torch.Generator().manual_seed(seed)
    num_features, slice_sizes = LAYOUTS[layout]
    n_slices, out_features = len(slice_sizes), sum(slice_sizes)
    if mixed_ranks:
        ranks = torch.randint(1, max_rank + 1, (max_loras,), generator=gen, dtype=torch.int32)
        ranks[0], ranks[-1] = 1, max_rank  # both ends always present
    else:
        ranks = torch.full((max_loras,), max_rank, dtype=torch.int32)
    keep = (torch.arange(max_rank)[None, :] < ranks[:, None]).double()  # [L, R]
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    lora_a = rand(max_loras, n_slices, max_rank, num_features) / num_features ** 0.5
    lora_b = rand(max_loras, out_features, max_rank) / max_rank ** 0.5
    case = Case(x=rand(num_tokens, num_features), y=rand(num_tokens, out_features),
                lora_a=lora_a * keep[:, None, :, None], lora_b=lora_b * keep[:, None, :],
                token_slots=token_slots_for(popularity, num_tokens, max_loras, gen),
                slot_ranks=ranks, slice_sizes=slice_sizes)
    return case.to(dtype)


def naive_add_lora(case: Case) -> torch.Tensor:
    """Per-token float64 loop straight from the formula: the oracle of the oracle."""
    y = case.y.double().clone()  # [T, N]
    for t, slot in enumerate(case.token_slots.tolist()):
        if slot < 0:
            continue
        offset = 0
        for j, width in enumerate(case.slice_sizes):
            inter = case.x[t].double() @ case.lora_a[slot, j].double().T  # [R]
            y[t, offset:offset + width] += inter @ case.lora_b[slot, offset:offset + width].double().T
            offset += width
    return y


def float64_add_lora(y, x, lora_a, lora_b, meta: LoRAMeta, slice_sizes) -> torch.Tensor:
    """The oracle of the other backends: the torch path in float64 on the (rounded) inputs."""
    y64 = y.double().clone()
    add_lora(y64, x.double(), lora_a.double(), lora_b.double(), meta, slice_sizes, backend="torch")
    return y64


def prepared_meta(case: Case, max_num_tokens: int | None = None, with_ranks: bool = False,
                  **kwargs) -> LoRAMeta:
    meta = LoRAMeta(max_num_tokens or max(1, case.x.shape[0]), case.lora_a.shape[0],
                    case.x.device, **kwargs)
    load_table(meta, case.token_slots, case.slot_ranks if with_ranks else None)
    return meta


@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens,layout", [(1, "qkv"), (7, "gate_up"), (64, "o"),
                                               (300, "gate_up")])
def test_torch_add_lora_matches_per_token_loop(num_tokens, layout, popularity):
    case = make_case(num_tokens, layout, 16, popularity, mixed_ranks=True, seed=num_tokens,
                     dtype=torch.float64)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case), case.slice_sizes,
             backend="torch")
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])  # bit-identical


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2),
                                       (torch.float16, 3e-3)])
def test_torch_add_lora_low_precision(dtype, tol):
    case = make_case(50, "qkv", 8, "mixed_none", seed=3, dtype=dtype)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case), case.slice_sizes)  # auto
    torch.testing.assert_close(y.double(), naive_add_lora(case), rtol=tol, atol=tol)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


def test_torch_shrink_then_expand_equals_add_lora():
    case = make_case(40, "qkv", 8, "mixed_none", seed=5, dtype=torch.float64)
    meta = prepared_meta(case)
    inter = torch.full((40, 3, 8), float("nan"), dtype=torch.float64)  # poisoned
    lora_shrink(case.x, case.lora_a, meta, inter, backend="torch")
    lora_rows = case.token_slots >= 0
    slots = case.token_slots[lora_rows]
    expected = torch.einsum("tk,tjrk->tjr", case.x[lora_rows], case.lora_a[slots])  # [m, n, R]
    torch.testing.assert_close(inter[lora_rows], expected, rtol=1e-12, atol=1e-12)
    assert inter[~lora_rows].isnan().all()  # rows of slot -1 tokens are not written
    y = case.y.clone()
    lora_expand(y, inter, case.lora_b, meta, case.slice_sizes, backend="torch")
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


def test_torch_path_ignores_slot_ranks_with_zero_padding():
    case = make_case(30, "gate_up", 32, "uniform", mixed_ranks=True, seed=9, dtype=torch.float64)
    y = case.y.clone()
    add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case, with_ranks=True),
             case.slice_sizes, backend="torch")
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the torch strategies, forced
PATHS = ("runs", "padded", "segmented")  # runs: every run of a slot's consecutive tokens in place


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("popularity", POPULARITY)
@pytest.mark.parametrize("num_tokens,layout", [(1, "o"), (9, "qkv"), (64, "qkv_wide"),
                                               (200, "gate_up")])
def test_torch_paths_match_per_token_loop(path, popularity, num_tokens, layout):
    case = make_case(num_tokens, layout, 16, popularity, mixed_ranks=True,
                     seed=7 * num_tokens + len(popularity), dtype=torch.float64)
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case),
                       case.slice_sizes, path=path)
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])  # bit-identical


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["o", "qkv", "gate_up"])
def test_torch_paths_take_b_with_columns_contiguous(path, layout):
    """The CPU slots store B transposed (adapters.slots.zeros_b): every path gives the loop's result
    from that view, and the same numbers as from contiguous B."""
    case = make_case(40, layout, 16, "uniform", mixed_ranks=True, seed=5, dtype=torch.float32)
    lora_b_t = case.lora_b.transpose(1, 2).contiguous().transpose(1, 2)  # [L, N, R] view of [L, R, N]
    meta = prepared_meta(case)
    y_t, y = case.y.clone(), case.y.clone()
    reference.add_lora(y_t, case.x, case.lora_a, lora_b_t, meta, case.slice_sizes, path=path)
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, path=path)
    torch.testing.assert_close(y_t.double(), naive_add_lora(case), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_t, y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_torch_paths_shrink_expand_poisoned(path):
    case = make_case(33, "qkv", 8, "mixed_none", mixed_ranks=True, seed=21, dtype=torch.float64)
    meta = prepared_meta(case)
    inter = torch.full((33, 3, 8), float("nan"), dtype=torch.float64)  # poisoned
    reference.lora_shrink(case.x, case.lora_a, meta, inter, path=path)
    lora_rows = case.token_slots >= 0
    expected = torch.einsum("tk,tjrk->tjr", case.x[lora_rows],
                            case.lora_a[case.token_slots[lora_rows]])  # [m, n, R]
    torch.testing.assert_close(inter[lora_rows], expected, rtol=1e-12, atol=1e-12)
    assert inter[~lora_rows].isnan().all()
    y = case.y.clone()
    reference.lora_expand(y, inter, case.lora_b, meta, case.slice_sizes, path=path)
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


@pytest.mark.parametrize("path", PATHS)
def test_torch_paths_float32_nan_rows_stay_local(path):
    """A NaN in the input row of a slot -1 token must not leak into LoRA rows (padding rows of the
    padded path repeat LoRA tokens, never other rows)."""
    case = make_case(40, "gate_up", 16, "mixed_none", seed=4, dtype=torch.float32)
    case.x[case.token_slots < 0] = float("nan")
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case),
                       case.slice_sizes, path=path)
    lora_rows = case.token_slots >= 0
    torch.testing.assert_close(y[lora_rows].double(), naive_add_lora(case)[lora_rows],
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


def test_torch_layout_follows_every_prepare():
    """The per-prepare layout cache must not serve a previous batch's token order."""
    first = make_case(24, "qkv", 8, "uniform", seed=1, dtype=torch.float64)
    meta = prepared_meta(first, max_num_tokens=64)
    y = first.y.clone()
    add_lora(y, first.x, first.lora_a, first.lora_b, meta, first.slice_sizes, backend="torch")
    for seed, num_tokens in ((2, 24), (3, 50)):  # same T with new slots, then a new T
        case = make_case(num_tokens, "qkv", 8, "skewed", seed=seed, dtype=torch.float64)
        load_table(meta, case.token_slots)
        y = case.y.clone()
        add_lora(y, case.x, first.lora_a, first.lora_b, meta, case.slice_sizes, backend="torch")
        case.lora_a, case.lora_b = first.lora_a, first.lora_b
        torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- runs in place next to gathered tokens
# An engine step: prefill chunks (runs of one slot, or of no adapter) and decode tokens, in batch order.
# qkv_wide (K + N = 896) takes runs of >= 19 tokens in place by default; the rest is gathered.
STEPS = {
    "prefills_and_decodes": [(3, 40), (-1, 25), (3, 1), (0, 1), (5, 1), (0, 60), (5, 1), (-1, 1), (0, 30)],
    "one_slot": [(2, 50), (2, 1), (-1, 3), (2, 30)],  # one slot: runs and its decode tokens
    "gaps_in_slot_ids": [(1, 33), (6, 2), (-1, 20), (7, 45), (1, 1), (6, 1)],  # slots 0, 2-5 absent
    "runs_only": [(4, 64), (1, 19), (-1, 10), (4, 21)],  # every LoRA token in a run: nothing gathered
    "neighbours_share_a_slot": [(2, 10), (2, 10), (5, 5), (2, 15)],  # 10 + 10 decode-like tokens join
}


def step_case(pieces, layout: str = "qkv_wide", dtype=torch.float64, seed: int = 0) -> Case:
    """make_case's random weights and rows, with token slots laid out as an engine step's."""
    num_tokens = sum(length for _, length in pieces)
    case = make_case(num_tokens, layout, 16, "uniform", mixed_ranks=True, seed=seed, dtype=dtype)
    case.token_slots = torch.cat([torch.full((length,), slot) for slot, length in pieces])
    return case


def expected_runs(pieces, min_run: int) -> list[tuple[int, int, int]]:
    """(slot, first token, end token) of the runs of >= min_run tokens, from the pieces."""
    runs, start = [], 0
    for slot, length in pieces:
        if runs and runs[-1][0] == slot and runs[-1][2] == start:  # neighbouring pieces of a slot join
            runs[-1] = (slot, runs[-1][1], start + length)
        elif slot >= 0:
            runs.append((slot, start, start + length))
        start += length
    return sorted((run for run in runs if run[2] - run[1] >= min_run), key=lambda run: (run[0], run[1]))


@pytest.mark.parametrize("step", STEPS)
def test_torch_runs_in_place_next_to_gathered_tokens(step):
    pieces = STEPS[step]
    case = step_case(pieces, seed=len(step))
    meta = prepared_meta(case)
    in_features, out_features = case.x.shape[1], case.y.shape[1]
    min_run = reference.min_run_tokens(in_features, out_features)
    layout = reference._layout(meta, min_run)
    assert sorted(layout.runs) == expected_runs(pieces, min_run)
    in_runs = sum(end - begin for _, begin, end in layout.runs)
    assert layout.tokens.shape[0] == int((case.token_slots >= 0).sum()) - in_runs
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)  # auto: runs + rest
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])  # bit-identical


@pytest.mark.parametrize("step", STEPS)
def test_torch_runs_shrink_expand_poisoned(step):
    """The halves (vocab LoRA's path) with their own run lengths (K alone, N alone)."""
    case = step_case(STEPS[step], seed=3 + len(step))
    meta = prepared_meta(case)
    n_slices, rank = case.lora_a.shape[1:3]
    inter = torch.full((case.x.shape[0], n_slices, rank), float("nan"), dtype=torch.float64)  # poisoned
    reference.lora_shrink(case.x, case.lora_a, meta, inter)
    lora_rows = case.token_slots >= 0
    expected = torch.einsum("tk,tjrk->tjr", case.x[lora_rows], case.lora_a[case.token_slots[lora_rows]])
    torch.testing.assert_close(inter[lora_rows], expected, rtol=1e-12, atol=1e-12)
    assert inter[~lora_rows].isnan().all()  # rows of slot -1 tokens are not written
    y = case.y.clone()
    reference.lora_expand(y, inter, case.lora_b, meta, case.slice_sizes)
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


@pytest.mark.parametrize("path", [None, "runs"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2), (torch.float16, 3e-3)])
def test_torch_runs_low_precision_nan_rows_stay_local(dtype, tol, path):
    """Runs in y's rows (float32) or through a float32 copy rounded once (half dtypes); a NaN in
    the input row of a slot -1 token stays in that row."""
    case = step_case(STEPS["prefills_and_decodes"], dtype=dtype, seed=11)
    case.x[case.token_slots < 0] = float("nan")
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, prepared_meta(case), case.slice_sizes, path=path)
    lora_rows = case.token_slots >= 0
    torch.testing.assert_close(y[lora_rows].double(), naive_add_lora(case)[lora_rows], rtol=tol, atol=tol)
    assert torch.equal(y[~lora_rows], case.y[~lora_rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_runs_column_scale_one_is_plain_lora_bit_for_bit(dtype):
    """A run scales B's rows by c (instead of the delta): c = 1 must still give the unscaled result."""
    case = step_case(STEPS["prefills_and_decodes"], dtype=dtype, seed=5)
    meta = prepared_meta(case)
    max_loras, n_slices = case.lora_a.shape[:2]
    ones = torch.ones(max_loras, case.y.shape[1])
    bias = torch.randn(case.y.shape[1]).to(dtype)
    for path in (None, "runs"):
        plain, scaled = case.y.clone(), case.y.clone()
        reference.add_lora(plain, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, path=path)
        reference.add_lora(scaled, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes,
                           reference.Scales(torch.ones(max_loras, n_slices), ones, bias), path=path)
        assert torch.equal(scaled, plain), path


def test_torch_runs_follow_every_prepare():
    """The per-prepare cache (runs and the rest's layout) must not serve a previous step's runs."""
    first = step_case(STEPS["prefills_and_decodes"], seed=1)
    meta = prepared_meta(first, max_num_tokens=256)
    for seed, step in ((2, "gaps_in_slot_ids"), (3, "one_slot"), (4, "prefills_and_decodes")):
        case = step_case(STEPS[step], seed=seed)
        case.lora_a, case.lora_b = first.lora_a, first.lora_b
        load_table(meta, case.token_slots)
        y = case.y.clone()
        reference.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes)
        torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("slots,view", [((0, 2, 3), True), ((1, 3, 4), True), ((2, 5), True), ((0, 7), False),
                                        ((0, 1, 6, 7), True), ((1, 6), False)])
def test_torch_padded_path_views_a_range_of_slots_with_few_absent(slots, view):
    """Present slots with at most as many absent ones between them read a view of the weights
    (the absent slots' rows computed and dropped), else a gather; both exact."""
    case = make_case(4 * len(slots) + 3, "qkv", 8, "uniform", mixed_ranks=True, seed=len(slots),
                     dtype=torch.float64)
    chosen = torch.tensor(slots)[torch.arange(case.x.shape[0] - 3) % len(slots)]
    case.token_slots = torch.cat([chosen, torch.full((3,), -1)])[torch.randperm(case.x.shape[0])]
    case.lora_a[[slot for slot in range(8) if slot not in slots]] = float("nan")  # absent slots' rows dropped
    case.lora_b[[slot for slot in range(8) if slot not in slots]] = float("nan")
    meta = prepared_meta(case)
    layout = reference._layout(meta)
    assert (layout.first_slot is not None) == view
    assert layout.present.tolist() == (list(range(slots[0], slots[-1] + 1)) if view else list(slots))
    y = case.y.clone()
    reference.add_lora(y, case.x, case.lora_a, case.lora_b, meta, case.slice_sizes, path="padded")
    torch.testing.assert_close(y, naive_add_lora(case), rtol=1e-12, atol=1e-12)
    untouched = case.token_slots < 0
    assert torch.equal(y[untouched], case.y[untouched])


def test_torch_path_choice_by_measured_crossover():
    """Decode batches of small models take the padded path (cost flat in the adapters); 7B-wide
    layers and long prefills over many slots take the per-slot path."""
    def layout_for(num_tokens, max_loras):
        meta = LoRAMeta(num_tokens, max_loras)
        load_table(meta, torch.arange(num_tokens) % max_loras)
        return reference._layout(meta)

    assert reference.use_padded(layout_for(64, 32), 3, 16, 64, 128)  # tiny qkv, 32 adapters
    assert reference.use_padded(layout_for(256, 8), 3, 16, 768, 1280)  # 100M qkv
    assert not reference.use_padded(layout_for(4, 4), 3, 16, 4096, 12288)  # 7B qkv
    assert not reference.use_padded(layout_for(4096, 8), 1, 16, 2048, 768)  # 4096-token prefill
    # runs in place: a prefill chunk on every layer of the 100M model, not tiny-model decode neighbours
    assert [reference.min_run_tokens(768, out) for out in (1280, 4096, 768)] == [8, 4, 11]
    assert reference.min_run_tokens(2048, 768) == 6  # 100M down
    assert reference.min_run_tokens(64, 128) == 86  # tiny qkv
    assert reference.min_run_tokens(4096, 12288) == reference.MIN_RUN_TOKENS  # 7B qkv: the floor
    meta = LoRAMeta(2048, 8)
    load_table(meta, torch.arange(2048) // 256)  # 8 prefill chunks of 256 tokens, one adapter each
    layout = reference._layout(meta, reference.min_run_tokens(768, 1280))
    assert len(layout.runs) == 8 and not layout.segments  # all in place, nothing gathered
    load_table(meta, torch.arange(64) % 8)  # decode: 64 requests round-robin over 8 adapters
    assert not reference._layout(meta, reference.min_run_tokens(768, 1280)).runs


def test_triton_available_reports_the_import(monkeypatch, caplog):
    """punica_kernels.triton_available() is what cuda_graphs asks before capturing LoRA."""
    import punica_kernels
    from lora_runner.worker.cuda_graphs import cuda_graphs_available
    from punica_kernels import ops

    assert punica_kernels.triton_available() == (ops.triton_ops is not None)
    assert punica_kernels.triton_import_error() is None or not punica_kernels.triton_available()
    error = ImportError("No module named 'triton'")
    monkeypatch.setattr(ops, "triton_ops", None)
    monkeypatch.setattr(ops, "_TRITON_IMPORT_ERROR", error)
    assert not punica_kernels.triton_available()
    assert punica_kernels.triton_import_error() is error
    with caplog.at_level("WARNING", logger="lora_runner.worker.cuda_graphs"):
        assert not cuda_graphs_available(torch.device("cuda"))  # no Triton: no graphs, said why
    assert "No module named 'triton'" in caplog.text
