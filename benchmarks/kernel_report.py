"""Resource report of every Triton kernel configuration the engine launches, compiled ahead of time.

The launchers are driven (kernel_tools.aot.all_drivers) with CPU tensors; each distinct
configuration is compiled for sm_90 (H100/H200) and sm_80 (A100) without a GPU, and ptxas -v on
its PTX gives registers and spills. One table per kernel:
  target, dtypes, constexprs, warps, registers/thread, spill bytes (stores+loads), shared memory,
  resident warps per SM (limited by 2048 threads, 64K registers, 228/164 KB shared per SM) and
  occupancy (resident warps / 64), from the PTX: global loads (any width), scalar 16-bit global loads inside loops (loads
  Triton could not vectorize, one round trip per element row) and cp.async copies (its pipeline);
  variants: configs that print alike (they differ only in how Triton specialized an argument,
  e.g. a stride divisible by 16 or not).
Then the SGMV decode step at the GPU run's shape (aot.decode_step: 32 sequences on 8 of 32 slots,
rank 16, bf16), plain LoRA and with DoRA's column scales: per packed module the traced shrink/expand grids, their programs with work (from the
real meta after a prepare) and the bytes moved over the ideal (A, B of the slots used, x, y).

    python benchmarks/kernel_report.py                  # both targets (a few minutes on 2 cores)
    python benchmarks/kernel_report.py --targets sm_90 --kernels sgmv   # the SGMV kernels only
    python benchmarks/kernel_report.py --kernels moe    # the fused MoE kernels only

Writes results/kernel_report-<time>.json (``--out`` to change) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine_description, markdown_table  # benchmarks/common.py
from kernel_tools import aot

COLUMNS = [("target", "target", "s"), ("dtypes", "dtypes", "s"), ("constexprs", "constexprs", "s"),
           ("num_warps", "warps", "d"), ("registers", "regs", "d"), ("spill_bytes", "spills B", "d"),
           ("shared_kb", "smem KB", ".1f"), ("warps_per_sm", "warps/SM", "d"), ("occupancy", "occupancy", ".2f"),
           ("global_loads", "ld.global", "d"), ("scalar_half_in_loops", "b16 ld in loops", "d"),
           ("cp_async", "cp.async", "d"),
           ("variants", "variants", "d")]
DECODE_COLUMNS = [("packed", "module", "s"), ("shrink_grid", "shrink grid", "s"), ("shrink_work", "with work", "d"),
                  ("expand_grid", "expand grid", "s"), ("expand_programs", "expand programs", "d"),
                  ("expand_work", "with work", "d"), ("bytes_ratio", "bytes / ideal", ".3f")]
DRIVERS = {"all": aot.all_drivers, "sgmv": aot.sgmv_drivers, "moe": aot.moe_drivers}


def report_row(report: aot.KernelReport) -> dict:
    """One table/JSON row of a compiled configuration."""
    config = report.config
    constexprs = config.named_constexprs()
    loads = aot.ptx_loads(report.ptx)
    return dict(kernel=config.name, target=report.target.name, dtypes=config.dtypes(),
                constexprs=" ".join(f"{k}={v}" for k, v in constexprs.items()), constexpr_values=constexprs,
                signature=config.signature, num_warps=report.num_warps, registers=report.registers,
                spill_stores=report.spill_stores, spill_loads=report.spill_loads, spill_bytes=report.spills,
                shared=report.shared, shared_kb=report.shared / 1024, fits_shared=report.fits_shared,
                warps_per_sm=report.warps_per_sm(), occupancy=report.occupancy(),
                global_loads=loads.global_loads, scalar_half_in_loops=loads.scalar_half_in_loops,
                cp_async=loads.cp_async)


def decode_rows(num_tokens: int = 32, num_adapters: int = 8, dora: bool = False) -> list[dict]:
    """The SGMV launches of one decode step at the GPU run's shape, per packed module, and the total
    (``dora``: with the slots' column scales, as when a DoRA adapter is in the step)."""
    rows = []
    for step in aot.decode_step(num_tokens, num_adapters, dora=dora):
        rows.append(dict(packed=step.packed, shrink_grid=str(step.shrink.launch.grid[:2]),
                         shrink_work=step.shrink.with_work, expand_grid=str(step.expand.launch.grid[:2]),
                         expand_programs=step.expand.programs, expand_work=step.expand.with_work,
                         bytes_moved=step.shrink.bytes_moved + step.expand.bytes_moved, ideal_bytes=step.ideal_bytes,
                         bytes_ratio=step.bytes_ratio))
    moved, ideal = sum(r["bytes_moved"] for r in rows), sum(r["ideal_bytes"] for r in rows)
    rows.append(dict(packed="step", shrink_grid="", shrink_work=sum(r["shrink_work"] for r in rows), expand_grid="",
                     expand_programs=sum(r["expand_programs"] for r in rows),
                     expand_work=sum(r["expand_work"] for r in rows), bytes_moved=moved, ideal_bytes=ideal,
                     bytes_ratio=moved / ideal))
    return rows


def table_rows(rows: list[dict]) -> list[dict]:
    """Rows sorted by target, dtypes and constexpr values; variants that differ only in argument
    specialization (e.g. a stride divisible by 16 or not) and print alike are shown once, counted."""
    shown: dict[tuple, dict] = {}
    for row in sorted(rows, key=lambda r: (r["target"], r["dtypes"], tuple(r["constexpr_values"].values()))):
        cells = tuple(row[key] for key, _, _ in COLUMNS if key != "variants")
        shown.setdefault(cells, dict(row, variants=0))["variants"] += 1
    return list(shown.values())


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", nargs="+", default=[t.name for t in aot.TARGETS],
                        choices=[t.name for t in aot.TARGETS])
    parser.add_argument("--kernels", choices=sorted(DRIVERS), default="all", help="which launchers to drive")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/...)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    drivers = DRIVERS[args.kernels]()
    configs = aot.collect_configs(drivers)
    collected = time.perf_counter()
    targets = [t for t in aot.TARGETS if t.name in args.targets]
    rows = [report_row(aot.compile_config(config, target)) for target in targets for config in configs.values()]
    compiled = time.perf_counter()

    for kernel in dict.fromkeys(row["kernel"] for row in rows):
        print(f"\n{kernel}")
        print(markdown_table(table_rows([r for r in rows if r["kernel"] == kernel]), COLUMNS))
    decode = {kind: decode_rows(dora=kind == "dora") for kind in ("plain", "dora")}
    for kind, title in (("plain", "plain LoRA"), ("dora", "with DoRA's column scales")):
        print(f"\nSGMV decode step, 32 sequences on 8 of 32 adapter slots (gpu_check shape, rank 16, bf16), {title}")
        print(markdown_table(decode[kind], DECODE_COLUMNS))
    problems = [r for r in rows if r["spill_bytes"] or not r["fits_shared"]]
    print(f"\n{len(configs)} configurations x {len(targets)} targets; {len(problems)} spill or exceed "
          f"shared memory; drive {collected - started:.1f} s, compile {compiled - collected:.1f} s")
    out = args.out or Path("results") / f"kernel_report-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_description("cpu"), targets=args.targets,
                                   drivers=[d.name for d in drivers], rows=rows, decode=decode["plain"],
                                   decode_dora=decode["dora"]), indent=2,
                              default=str))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
