"""The fused MoE kernels (punica_kernels.moe_triton) compile ahead of time for sm_90 and sm_80 without a GPU,
as kernel_tools.aot drives them (aot.moe_drivers, part of aot.all_drivers): the drivers reach every variant
the engine launches, and the widest ones fit without register spills.

tests/test_kernels_compile.py compiles every config of all_drivers, these included, for both targets; this
file checks the MoE variants are reached and compiles only the widest of each kernel (a fraction of a
minute), so a change to the MoE kernels is checked without the whole grid.
"""

from __future__ import annotations

import pytest
import torch

from kernel_tools import aot
from punica_kernels import moe_triton

TARGETS = {target.name: target for target in aot.TARGETS}
MOE_KERNELS = ("_moe_gemm_kernel", "_moe_lora_shrink_kernel", "_moe_lora_expand_kernel")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@pytest.fixture(scope="module")
def configs() -> dict[str, aot.KernelConfig]:
    return aot.collect_configs(aot.moe_drivers())


def _variants(configs, name: str, *constexprs: str) -> set:
    return {(c.dtypes().split(",")[0], *(c.named_constexprs()[k] for k in constexprs))
            for c in configs.values() if c.name == name}


def test_moe_drivers_are_in_the_compile_list():
    assert {d.name for d in aot.moe_drivers()} <= {d.name for d in aot.all_drivers()}


def test_drivers_reach_every_block_size_rank_slice_count_and_dtype(configs):
    """Both block sizes (decode, prefill) in every dtype; the GEMM with and without the routing weight;
    shrink of gate_up (two slices) and down (one) and expand with and without the weight, at each rank."""
    dtypes = set(DTYPE_NAMES.values())
    block_ms = {moe_triton.block_m_for(num_tokens * shape.top_k)
                for num_tokens in aot.MOE_TOKENS for shape in aot.MOE_MODELS.values()}
    assert block_ms == {moe_triton.DECODE_BLOCK_M, moe_triton.PREFILL_BLOCK_M}
    assert _variants(configs, "_moe_gemm_kernel", "BLOCK_M", "MUL_WEIGHT", "W_FP8") == {
        (d, m, w, fp8) for d in dtypes for m in block_ms for w in (False, True) for fp8 in (False, True)}
    assert _variants(configs, "_moe_lora_shrink_kernel", "BLOCK_M", "RANK", "N_SLICES") == {
        (d, m, r, n) for d in dtypes for m in block_ms for r in aot.MOE_LORA_RANKS for n in (1, 2)}
    assert _variants(configs, "_moe_lora_expand_kernel", "BLOCK_M", "RANK", "MUL_WEIGHT") == {
        (d, m, r, w) for d in dtypes for m in block_ms for r in aot.MOE_LORA_RANKS for w in (False, True)}


def _widest(configs) -> list[aot.KernelConfig]:
    """Per kernel, the fp32 and bf16 configs at the largest block and rank (the most registers); the GEMM's
    with FP8 weights too."""
    chosen = []
    for name in MOE_KERNELS:
        for dtype in ("fp32", "bf16"):
            for fp8 in ((False, True) if name == "_moe_gemm_kernel" else (False,)):
                candidates = [c for c in configs.values() if c.name == name and c.dtypes().split(",")[0] == dtype
                              and c.named_constexprs().get("W_FP8", False) == fp8]
                chosen.append(max(candidates, key=lambda c: (c.named_constexprs()["BLOCK_M"],
                                                             c.named_constexprs().get("RANK", 0),
                                                             c.named_constexprs().get("N_SLICES", 0))))
    return chosen


@pytest.mark.parametrize("target", list(TARGETS))
def test_widest_moe_configs_compile_fit_shared_memory_and_do_not_spill(configs, target):
    failures = []
    for config in _widest(configs):
        report = aot.compile_config(config, TARGETS[target])
        assert report.registers > 0
        if report.spills or not report.fits_shared:
            failures.append(f"{config.name} {config.dtypes()} {config.named_constexprs()}: {report.registers} regs, "
                            f"spills {report.spills} B, shared {report.shared} B")
    assert not failures, "\n".join(failures)
