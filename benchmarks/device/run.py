"""The one device command: everything the GPU can tell us, in one call, under 8 minutes on an H100.

    bash benchmarks/device/run.sh                # on the device (installs the carried .whl/ first)
    python benchmarks/device/run.py --dry-run    # here: the same plan at toy sizes on CPU, seconds to minutes

Parts, in order, each with its own time limit (``Plan.limits``) inside the overall budget; the JSON
is rewritten after every part, so a slow or failing part loses only its own results:

  setup      versions, the device, its measured copy bandwidth (GB/s, read + write): what % figures use
  tests      pytest -m gpu over the gpu test files: -n workers, a per-test timeout, junit + log to $OUT
  model      ONE random Llama-shaped model (gpu_check.write_random_model), written once, used by all below
  kernels    add_lora GB/s at decode sizes (gpu_check.run_kernels), % of the measured bandwidth
  splitk     the split-K shrink gives bitwise-identical outputs over repeated runs
  moe        fused MoE kernels vs a per-expert torch loop, base and with expert LoRA (bench_moe_kernels)
  profile    one graphed bf16 engine: lora_decode_profile's decode tok/s (requests x adapters, vs base),
             kernels per graph replay and us per kernel, host table ms, prefill with and without LoRA
  graphs     the same engine, graphs vs its eager path: same tokens, and graphs repeat bit for bit
  prefix     prefix-cache TTFT, cold vs cached prefix
  quant      decode tok/s at batch 1 and 32: bf16 (the same engine) vs FP8 and W4A16 engines
  spec       speculative decoding (spec_rows.py): decode tok/s and acceptance without speculation, with
             n-gram k=3 and with a draft model (the model truncated to its first layer), base and 8 adapters,
             and the draft model with per-request draft LoRAs (each adapter cut to the draft's layer), 8 adapters
  batch_invariant  decode tok/s with EngineConfig.batch_invariant vs default (graphs, adapters), and one
             request's tokens and logprobs bitwise equal alone and among the batch

Writes $OUT/device_run.json and $OUT/device_run.md (results/ when OUT is unset) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(HERE)]  # a script: the library and the benchmarks

HANG_GRACE_S = 60.0  # past the budget by this much: dump every thread's stack and exit (JSON already written)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sizes and time limits of one run (the GPU's, or the dry run's toy ones)."""

    profile: object  # lora_decode_profile.Plan: engine sizes, requests x adapters, prefill
    kernel_sizes: object  # gpu_check.Sizes of the kernels part
    test_workers: int
    test_timeout_s: int  # per test
    splitk_hidden: int
    splitk_tokens: tuple[int, ...]
    splitk_repeats: int
    prefix_len: int
    prefix_repeats: int
    quant_batches: tuple[int, ...]
    w4a16_group: int
    budget_s: float
    limits: dict  # part -> seconds
    moe_tokens: tuple[int, ...] = (1, 32, 256)  # the moe part's batch sizes
    spec_requests: int = 32  # the spec part: requests per row, their prompt and output lengths, adapters, k
    spec_prompt_len: int = 128
    spec_output_len: int = 64
    spec_adapters: tuple[int, ...] = (0, 8)
    spec_k: int = 3


def plans():
    """(GPU plan, dry-run plan)."""
    import gpu_check
    import lora_decode_profile as profile

    gpu = Plan(profile.GPU, dataclasses.replace(profile.GPU.sizes, kernel_tokens=(32, 128), kernel_ranks=(16,),
                                                kernel_distinct=(8, 32)),
               test_workers=8, test_timeout_s=120, splitk_hidden=4096, splitk_tokens=(1, 8, 32), splitk_repeats=50,
               prefix_len=1024, prefix_repeats=3, quant_batches=(1, 32), w4a16_group=128, budget_s=480.0,
               limits=dict(setup=20, tests=150, model=45, kernels=20, splitk=15, moe=25, profile=120, graphs=25,
                           prefix=15, quant=120, spec=90, batch_invariant=60))
    dry = Plan(profile.SMOKE, dataclasses.replace(gpu_check.CPU_SMOKE, kernel_tokens=(4,), kernel_ranks=(16,),
                                                  kernel_distinct=(2,)),
               test_workers=0, test_timeout_s=120, splitk_hidden=256, splitk_tokens=(1, 4), splitk_repeats=3,
               prefix_len=32, prefix_repeats=1, quant_batches=(1, 4), w4a16_group=32, budget_s=900.0,
               limits=dict(setup=20, tests=300, model=30, kernels=60, splitk=120, moe=60, profile=240, graphs=60,
                           prefix=30, quant=120, spec=240, batch_invariant=120), moe_tokens=(4,), spec_requests=4,
               spec_prompt_len=24, spec_output_len=12, spec_adapters=(0, 2))
    return gpu, dry


class Run:
    """The parts' shared state: the results, the one model directory and the one engine, the clock."""

    def __init__(self, plan: Plan, dry_run: bool, out_dir: Path) -> None:
        self.plan, self.dry_run, self.out_dir = plan, dry_run, out_dir
        self.start = time.time()
        self.results: dict = dict(mode="dry-run" if dry_run else "device", parts={}, skipped={})
        self.model_dir: Path | None = None
        self.engine = None

    def deadline(self, part: str) -> float:
        return min(time.time() + self.plan.limits[part], self.start + self.plan.budget_s)

    def write(self) -> None:
        """The results so far to device_run.json (token ids dropped: the checks compared them)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "device_run.json").write_text(json.dumps(self.results, indent=1, default=str))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the whole plan at toy sizes on CPU")
    parser.add_argument("--parts", default=None, help="comma-separated subset of the parts (default: all)")
    args = parser.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the split-K kernel on CPU (before triton is imported)
    import torch

    import parts
    from report import report

    gpu, dry = plans()
    plan = dry if args.dry_run else gpu
    if args.dry_run:
        torch.set_num_threads(1)  # toy sizes: threads only wait for each other on a busy machine
    elif not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --dry-run here")
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "results"
    run = Run(plan, args.dry_run, out_dir)
    faulthandler.dump_traceback_later(plan.budget_s + HANG_GRACE_S, exit=True)
    wanted = args.parts.split(",") if args.parts else list(parts.PARTS)
    with tempfile.TemporaryDirectory() as tmp:
        run.tmp = Path(tmp)
        for name in wanted:
            begin = time.time()
            try:
                skipped = parts.PARTS[name](run)
                status = f"skipped: {skipped}" if skipped else "ok"
            except Exception as exc:  # noqa: BLE001  (a failed part is recorded; the next one runs)
                status = f"FAILED: {exc!r}"[:300]
                run.results.setdefault("errors", {})[name] = traceback.format_exc()
                print(f"part {name} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            run.results["parts"][name] = dict(status=status, seconds=round(time.time() - begin, 1))
            run.write()
        parts.close_engine(run)
    faulthandler.cancel_dump_traceback_later()
    run.results["seconds"] = round(time.time() - run.start, 1)
    run.write()
    table = report(run.results)
    (out_dir / "device_run.md").write_text(table + "\n")
    print(table, flush=True)
    return run.results


if __name__ == "__main__":
    results = main()
    sys.exit(1 if results.get("errors") else 0)
