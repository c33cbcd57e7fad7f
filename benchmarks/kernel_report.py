"""Resource report of every Triton kernel configuration the engine launches, compiled ahead of time.

The launchers are driven (punica_kernels.aot.all_drivers) with CPU tensors; each distinct
configuration is compiled for sm_90 (H100/H200) and sm_80 (A100) without a GPU, and ptxas -v on
its PTX gives registers and spills. One table per kernel:
  target, dtypes, constexprs, warps, registers/thread, spill bytes (stores+loads), shared memory,
  resident warps per SM (limited by 2048 threads, 64K registers, 228/164 KB shared per SM) and
  occupancy (resident warps / 64); variants: configs that print alike (they differ only in how
  Triton specialized an argument, e.g. a stride divisible by 16 or not).

    python benchmarks/kernel_report.py                  # both targets (a few minutes on 2 cores)
    python benchmarks/kernel_report.py --targets sm_90

Writes results/kernel_report-<time>.json (``--out`` to change) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import machine_description, markdown_table  # benchmarks/common.py
from punica_kernels import aot

COLUMNS = [("target", "target", "s"), ("dtypes", "dtypes", "s"), ("constexprs", "constexprs", "s"),
           ("num_warps", "warps", "d"), ("registers", "regs", "d"), ("spill_bytes", "spills B", "d"),
           ("shared_kb", "smem KB", ".1f"), ("warps_per_sm", "warps/SM", "d"), ("occupancy", "occupancy", ".2f"),
           ("variants", "variants", "d")]


def report_row(report: aot.KernelReport) -> dict:
    """One table/JSON row of a compiled configuration."""
    config = report.config
    constexprs = config.named_constexprs()
    return dict(kernel=config.name, target=report.target.name, dtypes=config.dtypes(),
                constexprs=" ".join(f"{k}={v}" for k, v in constexprs.items()), constexpr_values=constexprs,
                signature=config.signature, num_warps=report.num_warps, registers=report.registers,
                spill_stores=report.spill_stores, spill_loads=report.spill_loads, spill_bytes=report.spills,
                shared=report.shared, shared_kb=report.shared / 1024, fits_shared=report.fits_shared,
                warps_per_sm=report.warps_per_sm(), occupancy=report.occupancy())


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
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default results/...)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    configs = aot.collect_configs(aot.all_drivers())
    collected = time.perf_counter()
    targets = [t for t in aot.TARGETS if t.name in args.targets]
    rows = [report_row(aot.compile_config(config, target)) for target in targets for config in configs.values()]
    compiled = time.perf_counter()

    for kernel in dict.fromkeys(row["kernel"] for row in rows):
        print(f"\n{kernel}")
        print(markdown_table(table_rows([r for r in rows if r["kernel"] == kernel]), COLUMNS))
    problems = [r for r in rows if r["spill_bytes"] or not r["fits_shared"]]
    print(f"\n{len(configs)} configurations x {len(targets)} targets; {len(problems)} spill or exceed "
          f"shared memory; drive {collected - started:.1f} s, compile {compiled - collected:.1f} s")
    out = args.out or Path("results") / f"kernel_report-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine_description("cpu"), targets=args.targets,
                                   drivers=[d.name for d in aot.all_drivers()], rows=rows), indent=2, default=str))
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
