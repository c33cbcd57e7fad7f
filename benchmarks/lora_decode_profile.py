"""Multi-LoRA decode and prefill against the base model on one GPU: the profile sections of the device run.

benchmarks/device/run.py (the one device command) runs these sections on its one model and engine;
this script runs them alone:

    python benchmarks/lora_decode_profile.py                 # one GPU (H200 target), well under 5 minutes
    python benchmarks/lora_decode_profile.py --smoke         # the same code paths at tiny sizes on CPU, seconds

One engine with decode CUDA graphs on gpu_check's random Llama-shaped model (hidden 4096, 8 layers, rank-16
dummy adapters on all seven projections, bf16), then:

  kernels  one decode graph replay at 32 requests / 8 adapters and its base twin under torch.profiler:
           kernels per replay, microseconds per kernel name, LoRA kernels' share of the step's GPU time
  prepare  host milliseconds per step of the LoRA meta's table, built on the host and staged (the engine's
           path, the only builder: HostTileTable.build + ForwardContextBuilder.prepare_lora), and the aten ops
           pointing the meta at it issues (a dispatch-mode count)
  decode   decode tok/s for 8 / 32 / 128 requests x 0 / 8 / 32 adapters (round-robin), and the ratio to base
  prefill  prefill tok/s of one step of T = 2048 / 8192 tokens (8 sequences), base vs 8 adapters

Prints a markdown table per section and writes everything to --json (default $OUT/lora_decode_profile.json
when OUT is set, else results/lora_decode_profile.json). On CPU the graphs are emulated (RerunGraph) and
the LoRA path is torch: the smoke mode checks the plumbing, not speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # a script: the library and gpu_check

import gpu_check  # noqa: E402  (after the path setup)
from common import markdown_table  # noqa: E402
from lora_runner.model.forward_context import PLAIN_LORA  # noqa: E402

logger = logging.getLogger("lora_decode_profile")

LORA_KERNELS = ("_shrink_kernel", "_expand_kernel", "_embedding_shrink_kernel")  # punica_kernels' Triton names


@dataclasses.dataclass(frozen=True)
class Plan:
    """The sizes of one run."""

    sizes: gpu_check.Sizes  # device, dtype, model, prompt / output lengths (gpu_check's engine helpers)
    requests: tuple[int, ...]
    adapters: tuple[int, ...]
    profile_point: tuple[int, int]  # (requests, adapters) of the profiled replay
    prefill_tokens: tuple[int, ...]
    prefill_seqs: int
    prefill_adapters: int
    repeats: int  # timed prefill steps / profiled replays / prepare calls per point


GPU = Plan(dataclasses.replace(gpu_check.GPU, num_requests=(8, 32, 128), adapter_counts=(0, 8, 32), output_len=48,
                               max_model_len=1100), (8, 32, 128), (0, 8, 32), (32, 8), (2048, 8192), 8, 8, 5)
SMOKE = Plan(dataclasses.replace(gpu_check.CPU_SMOKE, num_requests=(2, 4), adapter_counts=(0, 2), output_len=3,
                                 max_model_len=64), (2, 4), (0, 2), (4, 2), (32, 64), 4, 2, 1)


class AtenOps(TorchDispatchMode):
    """Counts the aten ops dispatched inside it, views apart (they launch nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += not func.is_view
        return func(*args, **(kwargs or {}))


def make_engine(model_dir: Path, plan: Plan):
    """A graphed engine serving max(adapters) dummy rank-16 adapters, its token budget the largest prefill."""
    return gpu_check.make_engine(model_dir, plan.sizes, graphs=True, max_loras=max(plan.adapters),
                                 max_num_seqs=max(plan.requests), max_num_batched_tokens=max(plan.prefill_tokens))


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run_decode(engine, plan: Plan, results: dict) -> None:
    """Decode tok/s per (requests, adapters), ratio to the base model at the same request count."""
    rows = results["decode"] = []
    for num_requests in plan.requests:
        base = None
        for num_adapters in plan.adapters:
            run = gpu_check.decode_run(engine, plan.sizes, num_requests, num_adapters, f"d{num_requests}-{num_adapters}")
            base = run["tokens_per_s"] if num_adapters == 0 else base
            steps = run["decode_tokens"] / num_requests
            rows.append(dict(requests=num_requests, adapters=num_adapters, tokens_per_s=run["tokens_per_s"],
                             ratio_to_base=run["tokens_per_s"] / base if base else float("nan"),
                             step_ms=run["seconds"] / steps * 1e3))
            logger.info("decode %d requests / %d adapters: %.0f tok/s", num_requests, num_adapters, run["tokens_per_s"])


def _prefill_requests(engine, plan: Plan, num_tokens: int, num_adapters: int, tag: str) -> None:
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(num_tokens)
    length = num_tokens // plan.prefill_seqs
    for i in range(plan.prefill_seqs):
        prompt = torch.randint(4, plan.sizes.model["vocab_size"], (length,), generator=gen).tolist()
        lora = LoRARequest(f"bench-{i % num_adapters}", "<dummy>") if num_adapters else None
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)


def run_prefill(engine, plan: Plan, results: dict) -> None:
    """Tokens/s of one step that prefills T tokens (prefill_seqs sequences), base vs prefill_adapters adapters."""
    rows = results["prefill"] = []
    for num_tokens in plan.prefill_tokens:
        base = None
        for num_adapters in (0, plan.prefill_adapters):
            seconds = []
            for repeat in range(plan.repeats + 1):  # the first: warm-up (compiles this T's kernels)
                _prefill_requests(engine, plan, num_tokens, num_adapters, f"p{num_tokens}-{num_adapters}-{repeat}")
                synchronize(plan.sizes.device)
                start = time.perf_counter()
                engine.step()
                synchronize(plan.sizes.device)
                seconds.append(time.perf_counter() - start)
                while engine.has_unfinished_requests():
                    engine.step()
            tokens_per_s = num_tokens / statistics.median(seconds[1:])
            base = tokens_per_s if num_adapters == 0 else base
            rows.append(dict(tokens=num_tokens, adapters=num_adapters, tokens_per_s=tokens_per_s,
                             ratio_to_base=tokens_per_s / base))
            logger.info("prefill T=%d / %d adapters: %.0f tok/s", num_tokens, num_adapters, tokens_per_s)


def run_prepare(engine, plan: Plan, results: dict) -> None:
    """Host ms per step of the LoRA table at the decode sizes (the host build + pointing the meta at the
    staged views), and the aten ops the latter issues."""
    from lora_runner.worker.batch_builder import SeqChunk

    runner = engine.runner
    builder, contexts = runner.batch_builder, runner.forward_contexts
    rows = []
    for num_requests in plan.requests:
        chunks = [SeqChunk([1, 2], 1, 1, [1], lora_slot=i % max(plan.adapters)) for i in range(num_requests)]
        step = builder.write(chunks)
        batch = builder.upload(step)  # the rows and the table in one copy
        host_ms = []
        for _ in range(plan.repeats * 20):
            start = time.perf_counter()  # the engine's path: the table in numpy (then staged), the meta pointed at it
            builder.lora_table.build(builder.token_lora_slots.np[:step.num_tokens])
            contexts.prepare_lora(batch)
            host_ms.append((time.perf_counter() - start) * 1e3)
        synchronize(plan.sizes.device)
        with AtenOps() as ops:
            contexts.prepare_lora(batch)
        rows.append(dict(requests=num_requests, host_table_ms=statistics.median(host_ms),
                         host_table_device_ops=ops.count))
    contexts.prepare_lora(builder.upload(step))  # leave the meta on the engine's path
    results["prepare"] = dict(rows=rows, host_table_device_ops=max(r["host_table_device_ops"] for r in rows))


def run_kernels(engine, plan: Plan, results: dict) -> None:
    """Profile replays of the decode graphs a (requests, adapters) step uses, with LoRA and base."""
    from lora_runner.worker.cuda_graphs import DecodeGraphKey

    num_requests, num_adapters = plan.profile_point
    graphs, device = engine.runner.decode_graphs, plan.sizes.device
    rows = results["kernels"] = []
    for has_lora in (True, False):
        # a real step of that mix fills the graph's buffers; replaying it again recomputes the same step
        gpu_check.decode_run(engine, dataclasses.replace(plan.sizes, output_len=2), num_requests,
                             num_adapters if has_lora else 0, f"k{has_lora}")
        features = engine.runner.lora_features(np.arange(num_adapters)) if has_lora else PLAIN_LORA
        key = graphs.plan.key_for(_decode_shape(num_requests, has_lora, features))
        captured = graphs._graphs[key]  # noqa: SLF001  (the benchmark replays one graph on its own)
        activity = ProfilerActivity.CUDA if device == "cuda" else ProfilerActivity.CPU
        with torch.inference_mode():  # as the runner replays (the graphs' tensors are inference tensors)
            captured.graph.replay()
            synchronize(device)
            with profile(activities=[activity]) as prof:
                for _ in range(plan.repeats):
                    captured.graph.replay()
                synchronize(device)
        rows.append(dict(key=str(key), **_kernel_summary(prof, device, plan.repeats)))
    with_lora, base = rows
    with_lora["lora_share_of_step"] = with_lora["lora_us"] / with_lora["step_us"] if with_lora["step_us"] else 0.0
    with_lora["step_vs_base"] = with_lora["step_us"] / base["step_us"] if base["step_us"] else float("nan")


def _decode_shape(num_seqs: int, has_lora: bool, features):
    from lora_runner.worker.batch_builder import BatchShape

    return BatchShape(num_tokens=num_seqs, num_seqs=num_seqs, num_samples=num_seqs, max_query_len=1, max_seq_len=2,
                      has_lora=has_lora, has_prompt_adapter=False, lora_features=features)


def _kernel_summary(prof, device: str, repeats: int) -> dict:
    """Kernels per replay, us per kernel name per replay, GPU (CPU: op) time per replay and the LoRA part."""
    if device == "cuda":
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    else:  # CPU: the aten ops the rerun issues (no kernels to see)
        events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    us, count = Counter(), Counter()
    for event in events:
        us[event.name] += event.time_range.elapsed_us()
        count[event.name] += 1
    per_kernel = {name: dict(us=us[name] / repeats, calls=count[name] / repeats) for name, _ in us.most_common(12)}
    lora_us = sum(t for name, t in us.items() if name.startswith(LORA_KERNELS)) / repeats
    return dict(kernels_per_replay=len(events) / repeats, step_us=sum(us.values()) / repeats, lora_us=lora_us,
                lora_kernels_per_replay=sum(c for n, c in count.items() if n.startswith(LORA_KERNELS)) / repeats,
                per_kernel=per_kernel)


def section_tables(results: dict) -> list[tuple[str, list | None, list]]:
    """(section, its rows, common.markdown_table columns: (key, header, format spec)) of each section."""
    return [("kernels", results.get("kernels"), [
        ("key", "graph", ""), ("kernels_per_replay", "kernels/replay", ".0f"),
        ("lora_kernels_per_replay", "LoRA kernels", ".0f"), ("step_us", "step us", ".1f"),
        ("lora_us", "LoRA us", ".1f"), ("lora_share_of_step", "LoRA share", ".1%")]),
        ("prepare", (results.get("prepare") or {}).get("rows"), [
            ("requests", "requests", "d"), ("host_table_ms", "host table ms", ".3f"),
            ("host_table_device_ops", "its device ops", "d")]),
        ("decode", results.get("decode"), [
            ("requests", "requests", "d"), ("adapters", "adapters", "d"), ("tokens_per_s", "decode tok/s", ".0f"),
            ("ratio_to_base", "vs base", ".2f"), ("step_ms", "ms/step", ".2f")]),
        ("prefill", results.get("prefill"), [
            ("tokens", "prefill T", "d"), ("adapters", "adapters", "d"), ("tokens_per_s", "tok/s", ".0f"),
            ("ratio_to_base", "vs base", ".2f")])]


def report(results: dict) -> str:
    """The sections' markdown tables."""
    lines = [f"## lora_decode_profile ({results['device']}, {results['seconds']:.0f} s)"]
    for _, rows, columns in section_tables(results):
        if rows:
            lines += ["", markdown_table(rows, columns)]
    lines += [f"{section}: FAILED {error}" for section, error in results.get("errors", {}).items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU (the plumbing, in seconds)")
    parser.add_argument("--json", type=Path, default=None, help="where the results go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    plan = SMOKE if args.smoke else GPU
    if args.smoke:
        torch.set_num_threads(1)  # tiny ops: threads only wait for each other (and for a busy machine)
    out = args.json or Path(os.environ.get("OUT") or ROOT / "results") / "lora_decode_profile.json"
    results = dict(device=plan.sizes.device, smoke=args.smoke, errors={})
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        gpu_check.write_random_model(Path(tmp), plan.sizes)
        engine = make_engine(Path(tmp), plan)
        gpu_check.decode_run(engine, plan.sizes, 4, 1, "warmup")  # compile kernels outside the timings
        for name, section in (("decode", run_decode), ("kernels", run_kernels), ("prepare", run_prepare),
                              ("prefill", run_prefill)):
            try:
                section(engine, plan, results)
            except Exception as error:  # noqa: BLE001  (one section failing must not lose the others)
                logger.exception("section %s failed", name)
                results["errors"][name] = repr(error)
        engine.adapters.manager.close()
    results["seconds"] = time.perf_counter() - start
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=str))
    print(report(results))
    return results


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
