"""The batch-invariant mode's CUDA kernels, run as their interpreted twins on CPU tensors (the tile loops,
split choices and key tiles are the GPU's): a row's bits alone equal its bits among 1..64 random
companions for the fixed-config GEMM (punica_kernels.invariant_triton.matmul), the row softmax, the unsplit SGMV
(punica_kernels.triton_ops.add_lora in the mode) and the prefill attention kernel with fixed key tiles
(lora_runner.model.batch_invariant.triton_paged_attention), while the default SGMV split and the default
key tiles do change a row's bits (so the comparisons can fail); the kernels compile for sm_90/sm_80
without spills; and an engine on a lent GPU gives one request bitwise-equal logprobs in 50 random batches.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from lora_runner import EngineConfig
from lora_runner.model import batch_invariant
from lora_runner.model.forward_context import AttentionMetadata
from punica_kernels import LoRAMeta, add_lora, invariant, invariant_triton, load_table, triton_ops

BATCH_SIZES = range(1, 65)


def _companion_batches(gen: torch.Generator, row: torch.Tensor, sizes=BATCH_SIZES):
    """(batch [n, K] with `row` at a random position among random rows, that position) for each size."""
    for size in sizes:
        batch = torch.randn(size, row.shape[0], generator=gen, dtype=row.dtype)
        position = int(torch.randint(size, (1,), generator=gen))
        batch[position] = row
        yield batch, position


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmul_row_bits_do_not_depend_on_the_batch(dtype):
    """A row alone and among 1..64 random rows: the same bits, through both column tiles, a K tail
    narrower than BLOCK_K and the bias epilogue; and the GEMM's values are x @ W.T + b's."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(150, 200, generator=gen).to(dtype)  # [N, K]: 2-3 column tiles, K not a multiple of BLOCK_K
    bias = torch.randn(150, generator=gen).to(dtype)
    row = torch.randn(200, generator=gen).to(dtype)
    alone = invariant_triton.matmul(row[None], weight, bias)[0]
    want = row.double() @ weight.double().T + bias.double()
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(alone.double(), want, **tolerance)
    for batch, position in _companion_batches(gen, row):
        assert torch.equal(invariant_triton.matmul(batch, weight, bias)[position], alone), batch.shape[0]


def test_rms_norm_matches_the_layer_and_its_rows_do_not_depend_on_the_batch():
    from lora_runner.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(1)
    for unit_offset in (False, True):
        norm = RMSNorm(96, 1e-6, torch.float32, "cpu", unit_offset=unit_offset)
        norm.weight.copy_(torch.randn(96, generator=gen))
        x = torch.randn(5, 3, 96, generator=gen)
        got = invariant_triton.rms_norm(x, norm.weight, norm.eps, unit_offset)
        torch.testing.assert_close(got, norm(x), rtol=1e-6, atol=1e-6)
        assert torch.equal(invariant_triton.rms_norm(x[2, 1:2], norm.weight, norm.eps, unit_offset)[0], got[2, 1])


# SGMV: K wide and slots many enough that the default split count changes between 1 and 64 tokens (18 vs 12)
SLICES, RANK, FEATURES, MAX_LORAS = (48, 16, 16), 16, 2304, 16


def _sgmv_operands(gen: torch.Generator):
    lora_a = torch.randn(MAX_LORAS, len(SLICES), RANK, FEATURES, generator=gen) / FEATURES ** 0.5
    lora_b = torch.randn(MAX_LORAS, sum(SLICES), RANK, generator=gen)
    slice_scales = torch.rand(MAX_LORAS, len(SLICES), generator=gen)
    return lora_a, lora_b, slice_scales


def _add_lora_row(meta, x, y, slots, position, lora_a, lora_b, slice_scales) -> torch.Tensor:
    load_table(meta, slots)
    out = add_lora(y.clone(), x, lora_a, lora_b, meta, SLICES, slice_scales=slice_scales, backend="triton")
    return out[position]


def _sgmv_batches(gen: torch.Generator, sizes):
    """(x [n, K], y [n, N], token slots [n], position) with the fixed token (slot 1) among random ones."""
    row_x, row_y = torch.randn(FEATURES, generator=gen), torch.randn(sum(SLICES), generator=gen)
    for size in sizes:
        x = torch.randn(size, FEATURES, generator=gen)
        y = torch.randn(size, sum(SLICES), generator=gen)
        slots = torch.randint(-1, MAX_LORAS, (size,), generator=gen)
        position = int(torch.randint(size, (1,), generator=gen))
        x[position], y[position], slots[position] = row_x, row_y, 1
        yield x, y, slots, position


def test_sgmv_in_the_mode_keeps_k_whole_and_row_bits_do_not_depend_on_the_batch():
    """The fixed token (slot 1) alone and among 3..64 tokens of random slots (none, its own, others) at a
    random position (batch sizes around the 16-token tiles): add_lora's row is the same bits in the mode (K
    unsplit), which the default split count (it follows T) would not keep."""
    gen = torch.Generator().manual_seed(2)
    meta = LoRAMeta(64, MAX_LORAS, "cpu", max_rank=RANK, max_slices=len(SLICES))
    operands = _sgmv_operands(gen)
    batches = list(_sgmv_batches(gen, [1, 3, 9, 16, 17, 33, 64]))
    with invariant.active():
        alone = _add_lora_row(meta, *batches[0], *operands)
        for batch in batches[1:]:
            assert torch.equal(_add_lora_row(meta, *batch, *operands), alone), batch[0].shape[0]
    # the default: the split count follows T, and the fixed token's bits with it
    splits = {triton_ops.choose_split_k(triton_ops.tile_programs(meta, n), FEATURES, 64) for n in (1, 64)}
    assert len(splits) == 2, splits
    default = [_add_lora_row(meta, *batch, *operands) for batch in (batches[0], batches[-1])]
    assert not torch.equal(default[0], default[1])
    torch.testing.assert_close(default[0], alone, rtol=1e-5, atol=1e-5)  # the mode computes the same delta


# attention: one sequence of 90 tokens, the fixed token at position 70, heads as GQA pairs
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, CONTEXT, FIXED = 4, 2, 32, 16, 90, 70


def _attention_case(kv: torch.Tensor, queries: torch.Tensor, chunk: tuple[int, int],
                    companions: list[tuple[int, int]]) -> tuple[torch.Tensor, AttentionMetadata, int]:
    """(flat query [T, H, D], metadata, the fixed token's row) of a step where the fixed sequence adds
    positions chunk[0]..chunk[1]-1 and each companion (context, new tokens) reads its own blocks."""
    num_blocks = kv.shape[1]
    seqs = [(chunk[1], chunk[1] - chunk[0])] + companions
    tables = torch.zeros(len(seqs), num_blocks, dtype=torch.int32)
    tables[0, :num_blocks // 2] = torch.arange(num_blocks // 2)  # the fixed sequence's blocks
    tables[1:, :num_blocks // 2] = torch.arange(num_blocks // 2, num_blocks)  # companions share the others
    parts, starts = [queries[chunk[0]:chunk[1]]], [0, chunk[1] - chunk[0]]
    for context, new in companions:
        parts.append(torch.randn(new, HEADS, HEAD_DIM))
        starts.append(starts[-1] + new)
    attn = AttentionMetadata(slot_mapping=torch.zeros(starts[-1], dtype=torch.int64),
                             query_start_loc=torch.tensor(starts, dtype=torch.int32),
                             seq_lens=torch.tensor([s for s, _ in seqs], dtype=torch.int32), block_tables=tables,
                             max_query_len=max(n for _, n in seqs), max_seq_len=max(s for s, _ in seqs))
    return torch.cat(parts), attn, FIXED - chunk[0]


def _attention_steps(gen: random.Random, count: int) -> list[tuple[tuple[int, int], list[tuple[int, int]]]]:
    """The fixed token decoded alone, then `count` random steps: chunks of the fixed sequence holding position
    FIXED (any start, any end) beside 0-4 companions (decodes and chunks of any length)."""
    steps = [((FIXED, FIXED + 1), [])]
    for _ in range(count):
        start = gen.randrange(0, FIXED + 1)
        chunk = (start, gen.randrange(FIXED + 1, CONTEXT + 1))
        companions = []
        for _ in range(gen.randrange(0, 5)):
            context = gen.randrange(1, 120)
            companions.append((context, gen.choice([1, gen.randrange(1, context + 1)])))
        steps.append((chunk, companions))
    return steps


@pytest.mark.parametrize("window, softcap", [(None, None), (24, 30.0)])
def test_attention_in_the_mode_row_bits_do_not_depend_on_chunk_or_batch(window, softcap):
    """The fixed token decoded alone and inside random chunks of its prompt beside random companions:
    the same bits through the one prefill kernel with key tiles at fixed positions; without fixed key
    tiles a sliding window starts the tiles at the chunk's first row and the bits change."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(2, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)  # [2, blocks, bs, H_kv, D]
    queries = torch.randn(CONTEXT, HEADS, HEAD_DIM, generator=gen)  # the fixed sequence's, by position
    scale = HEAD_DIM ** -0.5
    results = []
    for chunk, companions in _attention_steps(random.Random(4), 20):
        query, attn, row = _attention_case(kv, queries, chunk, companions)
        got = batch_invariant.triton_paged_attention(query, kv, attn, scale, window, softcap)
        results.append(got[row])
    assert all(torch.equal(result, results[0]) for result in results[1:])
    query, attn, _ = _attention_case(kv, queries, (FIXED, FIXED + 1), [])
    want = batch_invariant.paged_attention(query, kv, attn, scale, window, softcap, _attend())[0]  # the torch oracle
    torch.testing.assert_close(results[0], want, rtol=1e-5, atol=1e-5)
    if window is not None:  # the default tiles: some chunk start changes the fixed token's bits
        from lora_runner.model import paged_attention

        default = []
        for chunk in ((FIXED, FIXED + 1), (FIXED - 5, FIXED + 1), (FIXED - 9, FIXED + 1)):
            query, attn, row = _attention_case(kv, queries, chunk, [])
            default.append(paged_attention.prefill_attention(
                query, kv, attn.block_tables, attn.seq_lens, attn.query_start_loc, attn.max_query_len, scale,
                window, softcap=softcap)[row])
        assert not all(torch.equal(result, default[0]) for result in default[1:])


def test_the_mode_routes_triton_attention_to_the_fixed_tile_kernel(monkeypatch):
    """attention.paged_attention in the mode on the Triton backend: the fixed-tile prefill kernel, for a
    decode-only step too (outside the mode a decode-only step takes the decode kernel)."""
    from lora_runner.model import attention

    calls = []
    monkeypatch.setattr(batch_invariant, "triton_paged_attention", lambda *args: calls.append(args) or args[0])
    kv = torch.zeros(2, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    query, attn, _ = _attention_case(kv, torch.zeros(CONTEXT, HEADS, HEAD_DIM), (FIXED, FIXED + 1), [(5, 1)])
    with invariant.active():
        attention.paged_attention(query, kv, attn, 1.0, backend="triton")
    assert len(calls) == 1
    attention.paged_attention(query, kv, attn, 1.0, backend="triton")
    assert len(calls) == 1


def test_the_default_decode_kernel_splits_the_context_by_batch_size():
    """Why the mode never takes the decode kernel: its context split count follows the batch size, and a
    token's bits follow the split count."""
    from lora_runner.model import paged_attention

    splits = paged_attention.decode_num_splits
    assert splits(1, KV_HEADS, 32768) != splits(64, KV_HEADS, 32768)
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(2, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    query, attn, _ = _attention_case(kv, torch.randn(CONTEXT, HEADS, HEAD_DIM, generator=gen), (FIXED, FIXED + 1), [])
    by_splits = [paged_attention.decode_attention(query, kv, attn.block_tables, attn.seq_lens, HEAD_DIM ** -0.5,
                                                  num_splits=splits) for splits in (1, 4)]
    assert not torch.equal(*by_splits)


def _attend():
    from lora_runner.model.attention import _attend as attend

    return attend


def test_configs_refuse_only_what_the_cuda_mode_cannot_hold(monkeypatch):
    """On CUDA: Triton needed, at most two tensor-parallel ranks (NCCL's sum order), no quantized base."""
    import punica_kernels

    def check(**fields):
        config = dict(batch_invariant=True, quantization=None, tensor_parallel_size=1,
                      torch_device=lambda: torch.device("cuda"))
        EngineConfig._check_batch_invariant(SimpleNamespace(**{**config, **fields}))

    check()
    check(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size 1 or 2"):
        check(tensor_parallel_size=4)
    with pytest.raises(ValueError, match="unquantized"):
        check(quantization="fp8")
    monkeypatch.setattr(punica_kernels, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        check()


@pytest.mark.parametrize("target", ["sm_90", "sm_80"])
def test_invariant_kernels_compile_without_spills(target):
    """The mode's kernels at their widest (kernel_tools.aot.invariant_drivers) compile for the target,
    fit its shared memory and spill no registers."""
    from kernel_tools import aot

    configs = aot.collect_configs(aot.invariant_drivers())
    assert {config.name for config in configs.values()} == {"_matmul_kernel", "_rms_norm_kernel", "_softmax_kernel",
                                                            "_prefill_kernel", "_cumsum_kernel", "_top_kernel"}
    for config in configs.values():
        report = aot.compile_config(config, next(t for t in aot.TARGETS if t.name == target))
        assert report.spills == 0 and report.fits_shared, (config.name, config.dtypes(), report.registers)


@pytest.mark.gpu
def test_cuda_engine_is_bitwise_invariant_in_50_random_batches(engine_checkpoint, fixed_prompt):
    """On a lent GPU (bf16, decode graphs on): one request's tokens and logprobs in 50 random batches."""
    from test_batch_invariant import NUM_BATCHES, _differing

    assert _differing(engine_checkpoint, fixed_prompt, batch_invariant=True, num_batches=NUM_BATCHES,
                      device="cuda", dtype="bfloat16") == []


@pytest.mark.gpu
def test_cuda_engine_without_the_mode_differs(engine_checkpoint, fixed_prompt):
    """On a lent GPU the default kernels (cuBLAS by M, split-K by T, decode vs prefill attention) change the
    fixed request's bits in some batch: the comparison above can fail."""
    from test_batch_invariant import _differing

    assert _differing(engine_checkpoint, fixed_prompt, batch_invariant=False, num_batches=10, device="cuda",
                      dtype="bfloat16") != []


@pytest.fixture(scope="module")
def fixed_prompt():
    gen = random.Random(0)
    return [gen.randrange(3, 256) for _ in range(21)]


@pytest.mark.parametrize("log", [False, True])
def test_softmax_rows_match_torch_and_do_not_depend_on_the_batch(log):
    """The sampler's softmax and log-softmax in the mode on CUDA: torch's values, over a vocabulary that is not
    a multiple of the block nor of 4 (rows start at every alignment), -inf entries included (masked tokens)."""
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(2501, generator=gen) * 4
    row[::7] = float("-inf")
    alone = invariant_triton.softmax(row[None], log)[0]
    want = torch.log_softmax(row.double(), -1) if log else torch.softmax(row.double(), -1)
    torch.testing.assert_close(alone.double(), want, rtol=1e-5, atol=1e-6)
    for batch, position in _companion_batches(gen, row, (2, 5, 16, 33)):
        assert torch.equal(invariant_triton.softmax(batch, log)[position], alone), batch.shape[0]
