"""Every Triton kernel configuration the engine launches compiles for Hopper (sm_90) and Ampere
(sm_80), without a GPU, and fits: shared memory within the target's limit, no register spills.

Configurations come from driving the launchers (kernel_tools.aot.all_drivers) under
``record_launches``; the whole grid is compiled once per module (the slow part: a couple of CPU
minutes for both targets), then each test reads the reports.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernel_tools import aot
from punica_kernels import LoRAMeta, load_table, triton_ops

TARGETS = {target.name: target for target in aot.TARGETS}


@pytest.fixture(scope="module")
def configs() -> dict[str, aot.KernelConfig]:
    return aot.collect_configs(aot.all_drivers())


class _Reports(dict):
    """(config key, target name) -> report, compiled on first access: one compile per distinct config
    and target, and a run selecting one target's tests compiles for that target only."""

    def __init__(self, configs: dict[str, aot.KernelConfig]) -> None:
        super().__init__()
        self.configs = configs

    def __missing__(self, item: tuple[str, str]) -> aot.KernelReport:
        key, target = item
        self[item] = report = aot.compile_config(self.configs[key], TARGETS[target])
        return report


@pytest.fixture(scope="module")
def reports(configs) -> dict[tuple[str, str], aot.KernelReport]:
    return _Reports(configs)


def _values(configs, kernel_name: str, constexpr: str) -> set:
    return {c.named_constexprs()[constexpr] for c in configs.values() if c.name == kernel_name}


def test_drivers_reach_split_and_unsplit_shrinks_every_slice_count_rank_and_dtype(configs):
    """The drivers must reach the shrink with and without its K split (its split count is a runtime
    argument), each slice count, rank and dtype, and the expand's bias epilogue in each."""
    shrink_splits = {(c.dtypes(), c.named_constexprs()["RANK"], c.named_constexprs()["SPLIT"])
                     for c in configs.values() if c.name == "_shrink_kernel"}
    assert len(shrink_splits) == 3 * len(aot.LORA_RANKS) * 2  # split and unsplit in every dtype/rank
    for name in ("_shrink_kernel", "_expand_kernel"):
        assert _values(configs, name, "N_SLICES") == {1, 2, 3}
        assert _values(configs, name, "RANK") == set(aot.LORA_RANKS)
        assert {c.dtypes() for c in configs.values() if c.name == name} == {"bf16,fp32", "fp16,fp32", "fp32"}
    # the DoRA epilogue with and without the layer's bias, in every dtype and rank
    biased = {(c.dtypes(), c.named_constexprs()["RANK"], c.named_constexprs()["HAS_BIAS"])
              for c in configs.values() if c.name == "_expand_kernel"}
    assert len(biased) == 3 * len(aot.LORA_RANKS) * 2
    # steps with a DoRA slot (column scales) and without, in every dtype, rank and slice count
    epilogues = {(c.dtypes(), c.named_constexprs()["RANK"], c.named_constexprs()["N_SLICES"],
                  c.named_constexprs()["HAS_COLUMN_SCALES"]) for c in configs.values() if c.name == "_expand_kernel"}
    assert len(epilogues) == 3 * len(aot.LORA_RANKS) * 3 * 2
    # the real models' slice offsets are 16-aligned: every expand gets the vector hint
    assert _values(configs, "_expand_kernel", "COLUMN_ALIGN") == {16}


@pytest.mark.parametrize("target", list(TARGETS))
def test_sgmv_loads_are_vectorized_and_pipelined(configs, reports, target):
    """Issue 26 item 1: no SGMV config has a scalar 16-bit global load inside a loop (the shrink's K
    loop, the expand's tile and rank loops; loops found from LLVM's block annotations in the PTX,
    see aot.PtxLoads), nor a scalar 16-bit store of y, and every one copies global -> shared with
    cp.async (Triton's software pipeline)."""
    failures = []
    for key, config in configs.items():
        if config.name not in ("_shrink_kernel", "_expand_kernel"):
            continue
        loads = aot.ptx_loads(reports[key, target].ptx)
        assert loads.inner_loops >= 1, f"{config.name}: no loop found in its PTX"
        if loads.scalar_half_in_loops or loads.scalar_half_stores or not loads.cp_async:
            failures.append(f"{config.name} {config.dtypes()} {config.named_constexprs()}: {loads}")
    assert not failures, f"{len(failures)} SGMV configs on {target}:\n" + "\n".join(failures)


def test_plain_lora_expand_loads_less_than_the_dora_epilogue(configs, reports):
    """Issue 26 item 5: an expand without column scales (no DoRA slot in the step) compiles without
    the epilogue's loads: fewer global loads than its DoRA twin (same config, column scales on, no bias)."""
    target = next(iter(TARGETS))
    expands = {key: c for key, c in configs.items() if c.name == "_expand_kernel"}

    def twin_key(config: aot.KernelConfig) -> tuple:
        named = {k: v for k, v in config.named_constexprs().items() if k != "HAS_COLUMN_SCALES"}
        return config.dtypes(), tuple(sorted(named.items()))

    dora = {twin_key(c): key for key, c in expands.items()
            if c.named_constexprs()["HAS_COLUMN_SCALES"] and not c.named_constexprs()["HAS_BIAS"]}
    plain = {twin_key(c): key for key, c in expands.items() if not c.named_constexprs()["HAS_COLUMN_SCALES"]}
    pairs = [(plain[k], dora[k]) for k in plain.keys() & dora.keys()]
    assert len(pairs) >= 3 * len(aot.LORA_RANKS)  # every dtype and rank has both
    for plain_key, dora_key in pairs[:6]:  # a few pairs: each compile takes seconds
        fewer, more = (aot.ptx_loads(reports[key, target].ptx).global_loads for key in (plain_key, dora_key))
        assert 0 < fewer < more, (configs[plain_key].named_constexprs(), fewer, more)


def test_ptx_loads_tell_scalar_from_vector_and_find_nested_loops():
    ptx = """
	ld.global.b16 {%rs0}, [%rd0];
$L__BB0_2:                              // =>This Loop Header: Depth=1
	@%p1 ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd1];
$L__BB0_5:                              // %.lr.ph
                                        //   Parent Loop BB0_2 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
	@%p2 ld.global.b16 {%rs1}, [%rd2];
	cp.async.cg.shared.global [%r5], [%rd3], 16, %r6;
	@%p2 bra 	$L__BB0_5;
// %bb.6:                               //   in Loop: Header=BB0_2 Depth=1
	ld.global.L1::evict_last.u16 {%rs2}, [%rd4];
	bra.uni 	$L__BB0_2;
$L__BB0_7:
	st.global.b16 [%rd5], {%rs3};
	ret;
"""
    loads = aot.ptx_loads(ptx)
    assert (loads.loops, loads.inner_loops, loads.scalar_half_in_loops) == (2, 1, 2)  # not the entry block's
    assert (loads.scalar_half_stores, loads.cp_async, loads.vector_global) == (1, 1, 1)
    assert loads.global_loads == 4  # every ld.global, predicated or not; the cp.async apart


def test_drivers_reach_every_attention_kernel_split_count_and_dtype(configs):
    """Decode (unsplit and split), its combine at every split count decode_num_splits picks for each
    model, and prefill, in every dtype, head_dim and KV block size, with and without soft-capping."""
    from lora_runner.model import paged_attention

    def named(name):
        return [c for c in configs.values() if c.name == name]

    chosen = {(spec.head_dim, dtype, paged_attention.decode_num_splits(num_seqs, spec.num_kv_heads, capacity))
              for spec, _ in aot.ATTENTION_MODELS.values() for dtype in aot.DTYPES for num_seqs in aot.DECODE_TOKENS
              for capacity in aot.ATTENTION_CAPACITIES}
    dtype_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    expected = {(d, dtype_names[dtype], s) for d, dtype, s in chosen if s > 1}
    assert {s for _, _, s in expected} == {2, 4, 8, paged_attention.MAX_SPLITS}
    assert {(c.named_constexprs()["HEAD_DIM"], c.dtypes().split(",")[-1], c.named_constexprs()["NUM_SPLITS"])
            for c in named("_combine_kernel")} == expected
    shapes = {(spec.num_heads // spec.num_kv_heads, spec.head_dim, page)
              for spec, _ in aot.ATTENTION_MODELS.values() for page in aot.ATTENTION_BLOCK_SIZES}
    for name, dtypes in (("_decode_kernel", {"bf16,fp32", "fp16,fp32", "fp32"}),
                         ("_prefill_kernel", {"bf16", "fp16", "fp32"})):
        assert {c.dtypes() for c in named(name)} == dtypes
        assert {tuple(c.named_constexprs()[k] for k in ("GROUP", "HEAD_DIM", "PAGE")) for c in named(name)} == shapes
        softcaps = {(dtype, spec.head_dim, cap is not None)
                    for spec, caps in aot.ATTENTION_MODELS.values() for cap in caps for dtype in dtypes}
        assert {(c.dtypes(), c.named_constexprs()["HEAD_DIM"], c.named_constexprs()["SOFTCAP"])
                for c in named(name)} == softcaps
    assert {c.named_constexprs()["SPLIT"] for c in named("_decode_kernel")} == {False, True}


@pytest.mark.parametrize("target", list(TARGETS))
def test_every_config_compiles_fits_shared_memory_and_does_not_spill(configs, reports, target):
    limit = TARGETS[target].smem_per_block
    failures = []
    for key, config in configs.items():
        report = reports[key, target]
        assert report.registers > 0 and report.num_warps > 0
        if report.spills or not report.fits_shared:
            failures.append(f"{config.name} {config.dtypes()} {config.named_constexprs()} {dict(config.options)}: "
                            f"{report.registers} regs, spill stores {report.spill_stores} B / loads "
                            f"{report.spill_loads} B, shared {report.shared} B (limit {limit})")
    assert not failures, f"{len(failures)} of {len(configs)} configs on {target}:\n" + "\n".join(failures)


def test_recorded_config_is_specialized_like_the_jit():
    """Ints equal to 1 become constexprs, do_not_specialize ints stay plain i32, 16-divisible pointers
    and ints carry tt.divisibility: the variant a GPU would compile, not a restated one."""
    meta = LoRAMeta(8, 2, "cpu")
    load_table(meta, torch.tensor([0, 1, 0]))
    x, out = torch.empty(3, 64, dtype=torch.float16), torch.empty(3, 1, 16)
    with aot.record_launches() as recorded:
        triton_ops._launch_shrink(x, torch.empty(2, 1, 16, 64, dtype=torch.float16), meta, out)
    (config,) = recorded.values()
    index = {p.name: p.num for p in config.kernel.params}
    assert config.signature["x_ptr"] == "*fp16" and config.signature["out_ptr"] == "*fp32"
    assert config.signature["stride_xk"] == "constexpr" and config.constexprs[(index["stride_xk"],)] == 1
    assert config.signature["k_blocks_per_split"] == "i32" and (index["k_blocks_per_split"],) not in config.attrs
    assert config.attrs[(index["x_ptr"],)] == [["tt.divisibility", 16]]
    assert config.attrs[(index["num_features"],)] == [["tt.divisibility", 16]]
    assert config.named_constexprs()["N_SLICES"] == 1 and config.named_constexprs()["BLOCK_NR"] == 16


def test_recording_runs_nothing_and_restores_triton():
    saved = JITFunction.run
    meta = LoRAMeta(4, 2, "cpu")
    load_table(meta, torch.tensor([0, 1]))
    y = torch.full((2, 32), float("nan"))
    with aot.record_launches() as recorded:
        triton_ops.add_lora(y, torch.ones(2, 16), torch.ones(2, 1, 16, 16), torch.ones(2, 32, 16), meta, (32,))
    assert y.isnan().all()  # recorded, not run
    assert {c.name for c in recorded.values()} == {"_shrink_kernel", "_expand_kernel"}
    assert JITFunction.run is saved


@triton.autotune(configs=[triton.Config({"BLOCK": 32}, num_warps=1), triton.Config({"BLOCK": 64}, num_warps=2)],
                 key=["n"])
@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2, mask=offsets < n)


def test_autotuned_kernel_records_every_config_with_its_launch_options():
    with aot.record_launches() as recorded:
        _scale_kernel[(1,)](torch.empty(100), 100)
    assert sorted((c.named_constexprs()["BLOCK"], dict(c.options)["num_warps"]) for c in recorded.values()) == [
        (32, 1), (64, 2)]


def test_register_cap_shows_up_as_spills():
    """ptxas' spill lines are parsed (and launch options reach the compiler): the widest shrink
    config capped at 64 registers must spill on both targets."""
    meta = LoRAMeta(16, 2, "cpu")
    load_table(meta, torch.zeros(16, dtype=torch.int64))
    with aot.record_launches() as recorded:
        kernel = triton_ops._shrink_kernel
        x, lora_a, out = torch.empty(16, 256), torch.empty(2, 1, 64, 256), torch.empty(16, 1, 64)
        kernel[(1, 1)](x, lora_a, out, out, meta.slot_ranks, meta.sorted_tokens, meta.tile_slots, meta.tile_starts,
                       meta.tile_ends, meta.slot_ranks, 1, 256, 4, *x.stride(), *lora_a.stride(), *out.stride(), 0,
                       *out.stride(), N_SLICES=1, RANK=64, BLOCK_M=16, BLOCK_NR=64, BLOCK_K=64, SPLIT=False,
                       DOT_PRECISION="ieee", maxnreg=64)
    (config,) = recorded.values()
    report = aot.compile_config(config, TARGETS["sm_90"])
    assert report.registers <= 64 and report.spill_stores > 0 and report.spill_loads > 0


def test_occupancy_estimate_takes_the_tightest_limit():
    sm90 = TARGETS["sm_90"]

    def warps(registers, shared, num_warps=4):
        return aot.KernelReport(None, sm90, num_warps, shared, registers, 0, 0, "").warps_per_sm()

    assert warps(32, 0) == 64  # threads bound: 2048 / 128 = 16 blocks
    assert warps(128, 0) == 16  # registers: 128 * 32 = 4096 per warp, 65536 / (4 * 4096) = 4 blocks
    assert warps(129, 0) == 12  # rounded up to 136 per thread: 65536 // (4 * 4352) = 3 blocks
    assert warps(32, 100 * 1024) == 8  # shared: 228 KB // (100 + 1 KB) = 2 blocks
    assert warps(255, 0, num_warps=8) == 8


def test_drivers_reach_the_embedding_gather_in_every_rank_and_dtype(configs):
    """embed_tokens LoRA's gather shrink (punica_kernels.embedding_triton), as the engine launches it."""
    reached = {(c.named_constexprs()["RANK"], c.dtypes()) for c in configs.values()
               if c.name == "_embedding_shrink_kernel"}
    assert reached == {(rank, dtypes) for rank in aot.LORA_RANKS for dtypes in ("bf16,fp32", "fp16,fp32", "fp32")}


def test_drivers_reach_every_w4a16_format_tile_and_dtype(configs):
    """The W4A16 GEMM (punica_kernels.w4a16_triton) in each dtype, 4-bit format (zero points, act-order)
    and tile config its launcher picks, with and without the bias (Qwen2's qkv)."""
    from punica_kernels import w4a16_triton

    reached = {(c.dtypes().split(",")[0], c.named_constexprs()["HAS_ZEROS"], c.named_constexprs()["HAS_G_IDX"],
                c.named_constexprs()["BLOCK_M"], c.named_constexprs()["BLOCK_N"], c.named_constexprs()["BLOCK_K"],
                c.named_constexprs()["HAS_BIAS"]) for c in configs.values() if c.name == "_w4a16_kernel"}
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    expected = set()
    for dtype in aot.DTYPES:
        for zeros, act_order in aot.W4A16_FORMATS.values():
            for num_tokens in (1, 64, 8192):
                tile = w4a16_triton.tile_config(num_tokens, dtype, zeros or act_order)
                expected |= {(names[dtype], zeros, act_order, tile.block_m, tile.block_n, tile.block_k, bias)
                             for bias in (False, True)}
    assert reached == expected
