"""Engine benchmark: many adapters in one batch vs the same engine with no adapters vs PEFT.

For each workload (see benchmarks/common.py) three runs on the same model, adapters and prompts:
  engine + adapters  LLMEngine driven by add_request/step (arrivals replayed in real time)
  engine, base only  the same engine, every request without adapter: the limit we aim for
  PEFT               PeftModel.generate(..., adapter_names=[...]) on static batches (all arrived
                     requests at once; one batch at a time), what a user would run instead of us
All runs are greedy and ignore EOS, so each request yields exactly its drawn number of tokens
(PEFT pads a batch to its longest request; only the requested tokens count as output).

    python benchmarks/bench_engine.py --quick      # CPU, ~100M-parameter random model, < 5 min
    python benchmarks/bench_engine.py              # GPU, Llama-2-7B-shaped random model
    python benchmarks/bench_engine.py --quick --policy fair,fcfs --workloads 1 --skip-peft --fairness

--policy runs every workload under each scheduling policy (a row each: the cost of the policy).
--fairness adds a table that needs no model: the scheduler alone (a fake model that samples a fixed
token) on a skewed load, one tenant sending 10x the requests of two others, all at once, each tenant
with its own LoRA and 2 slots: each tenant's share of the weighted served tokens (prefill 1, decode 2)
while all three are backlogged, and the scheduler's own time per step.

--tensor-parallel-size N adds a table (benchmarks/tp_rows.py): one batch served at tp=1 and at tp=N
with the same total torch threads (--threads, split over the ranks), wall-clock tok/s, ms/step and the
ratio to tp=1; --tp-backend ray runs the ranks as Ray actors. Only that table, on CPU:
    python benchmarks/bench_engine.py --quick --workloads "" --skip-peft --tensor-parallel-size 2 --threads 2

--contention adds a table on the batch workload without adapters: the engine and transformers
generate() (static batch) serve the same requests, with no other load and then while a competing
busy process (a subprocess spinning on this process's last core) runs, once with the engine's
default intra-op thread count (EngineConfig.cpu_threads: the physical cores available) and once
with 1 thread; transformers runs with the same (process-global) thread count. tok/s per wall-clock
second there: contention shows as lost wall time. Only that table:
    python benchmarks/bench_engine.py --quick --workloads "" --skip-peft --contention

tok/s counts wall-clock seconds, except --quick on CPU, which runs one torch thread and counts this
process's CPU seconds (--clock process) so that other processes on a shared machine cannot skew the
ratios; TTFT is always wall-clock, from each request's arrival.

Writes results/bench_engine-<mode>-<time>.json (and a .png with the `bench` extra installed).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import torch
from tqdm.auto import tqdm

from common import (ModelShape, PeftRunner, WorkloadSpec, machine_description,  # benchmarks/common.py
                    make_workload, markdown_table, percentile, save_random_adapters, save_random_model,
                    write_report)
from tp_rows import TP_ADAPTERS, TP_COLUMNS, tp_rows  # benchmarks/tp_rows.py

logger = logging.getLogger("bench_engine")

QUICK_SHAPE = ModelShape(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
                         num_kv_heads=4)  # ~100M parameters (half in the 32000-token vocabulary)
FULL_SHAPE = ModelShape(hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                        num_kv_heads=32)  # Llama-2-7B
COLUMNS = [("workload", "workload", ""), ("policy", "policy", ""), ("max_loras", "max_loras", "d"),
           ("tokens_per_s", "out tok/s", ".1f"), ("ttft_p50_s", "TTFT p50 s", ".2f"),
           ("ttft_p99_s", "TTFT p99 s", ".2f"), ("loads", "slot loads", "d"),
           ("evictions", "slot evictions", "d"), ("disk_loads", "disk loads", "d"),
           ("base_tokens_per_s", "base tok/s", ".1f"), ("vs_base", "vs base", ".2f"),
           ("peft_tokens_per_s", "PEFT tok/s", ".1f"), ("vs_peft", "vs PEFT", ".2f"),
           ("same_as_peft", "same tokens as PEFT", ".0%")]


def quick_workloads(num_requests: int) -> list[WorkloadSpec]:
    """CPU grid: one row per popularity law and adapter count, paging at 32 and 128 adapters."""
    kw = dict(num_requests=num_requests, max_loras=8, prompt_len=(8, 32), output_len=(8, 24))
    return [
        WorkloadSpec(num_adapters=1, popularity="distinct", **kw),
        WorkloadSpec(num_adapters=8, popularity="distinct", **kw),  # issue 4's row: 8 distinct rank-16
        WorkloadSpec(num_adapters=32, popularity="uniform", **kw),
        WorkloadSpec(num_adapters=128, popularity="zipf", **kw),
        WorkloadSpec(num_adapters=8, popularity="uniform", arrival="poisson", rate=8.0, **kw),
        WorkloadSpec(num_adapters=128, popularity="zipf", arrival="poisson", rate=8.0, **kw),
    ]


def full_workloads(num_requests: int) -> list[WorkloadSpec]:
    """GPU grid: adapters 1/8/32/128 x popularity x arrivals; 16 slots, so 32 and 128 page."""
    kw = dict(num_requests=num_requests, max_loras=16, prompt_len=(32, 256), output_len=(32, 128))
    specs = []
    for arrival in ("batch", "poisson"):
        for num_adapters in (1, 8, 32, 128):
            for popularity in (("distinct",) if num_adapters == 1 else ("distinct", "uniform", "zipf")):
                specs.append(WorkloadSpec(num_adapters=num_adapters, popularity=popularity,
                                          arrival=arrival, rate=16.0, **kw))
    return specs


class EngineRunner:
    """Replays workloads through one LLMEngine (add_request/step), timing every request."""

    def __init__(self, model_dir: str, adapter_paths: list[Path], spec: WorkloadSpec, rank: int,
                 device: str, max_model_len: int, max_batched_tokens: int, policy: str = "fair",
                 cpu_threads: int | None = None, **engine_kwargs):
        from adapters import LoRARequest
        from lora_runner import LLMEngine

        self.engine = LLMEngine(model=model_dir, max_loras=spec.max_loras, max_lora_rank=rank,
                                max_cpu_loras=4 * spec.max_loras,  # CPU tier pages too at 128
                                device=device, max_num_seqs=spec.num_requests,
                                max_model_len=max_model_len, max_num_batched_tokens=max_batched_tokens,
                                scheduling_policy=policy, cpu_threads=cpu_threads, **engine_kwargs)
        self.loras = [LoRARequest(f"adapter-{i:03d}", str(p)) for i, p in enumerate(adapter_paths)]
        self._run_index = 0

    def run(self, requests, use_adapters: bool, desc: str) -> dict:
        """Serve `requests` (arrivals in real time); returns tokens, seconds and TTFTs."""
        from lora_runner import SamplingParams

        self._run_index += 1
        prefix = f"run{self._run_index}-"
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        arrival = {prefix + r.request_id: r.arrival_s for r in requests}
        first_token, token_ids, progress, steps = {}, {}, {}, 0
        stats_before = adapter_stats(self.engine)
        bar = tqdm(total=sum(r.max_tokens for r in requests), desc=desc, leave=False, unit="tok")
        start, cpu_start = time.perf_counter(), time.process_time()
        while pending or self.engine.has_unfinished_requests():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                r = pending.popleft()
                lora = self.loras[r.adapter] if use_adapters and r.adapter is not None else None
                params = SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
                self.engine.add_request(prefix + r.request_id, list(r.prompt_token_ids), params,
                                        lora_request=lora)
            if not self.engine.has_unfinished_requests():
                time.sleep(max(0.0, pending[0].arrival_s - now))
                continue
            steps += 1
            for out in self.engine.step():
                completion = out.outputs[0]
                if completion.finish_reason == "error":
                    raise RuntimeError(f"request {out.request_id} failed") from completion.error
                if completion.token_ids and out.request_id not in first_token:
                    first_token[out.request_id] = time.perf_counter() - start - arrival[out.request_id]
                bar.update(len(completion.token_ids) - progress.get(out.request_id, 0))
                progress[out.request_id] = len(completion.token_ids)
                if out.finished:
                    token_ids[out.request_id[len(prefix):]] = list(completion.token_ids)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        bar.close()
        stats_after = adapter_stats(self.engine)
        return {"tokens": sum(map(len, token_ids.values())), "seconds": seconds, "cpu_seconds": cpu_seconds,
                "steps": steps,
                "ttfts": list(first_token.values()), "token_ids": token_ids,
                **{k: stats_after[k] - stats_before[k] for k in stats_after}}


def adapter_stats(engine) -> dict:
    """Cumulative LoRA events of the engine's adapter manager (device slots and CPU cache)."""
    stats = engine.adapters.manager.stats
    return {"loads": stats.lora_loads, "evictions": stats.lora_evictions,
            "disk_loads": stats.lora_disk_loads, "cpu_evictions": stats.lora_cpu_evictions}


def run_workload(spec: WorkloadSpec, model_dir: str, adapter_paths: list[Path], args,
                 peft: PeftRunner | None, vocab_size: int, policy: str = "fair") -> dict:
    """Engine with adapters, the same engine without, and PEFT, on the same requests."""
    requests = make_workload(spec, vocab_size)
    max_len = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    runner = EngineRunner(model_dir, adapter_paths[: spec.num_adapters], spec, args.rank,
                          args.device, max_model_len=max_len + 16,
                          max_batched_tokens=max(2048, max_len + 16), policy=policy)
    runner.run(make_workload(WorkloadSpec(num_requests=2, num_adapters=1, seed=99, prompt_len=(4, 8),
                                          output_len=(2, 2)), vocab_size), True, "warm-up")
    base = lora = None
    for _ in range(args.repeats):  # interleaved, best of N: the machine's noise hits both alike
        base = _faster(base, runner.run(requests, False, f"{spec.name}: engine base"), args.clock)
        lora = _faster(lora, runner.run(requests, True, f"{spec.name}: engine"), args.clock)
    row = {"workload": spec.name, "policy": policy, "spec": spec.__dict__, "max_loras": spec.max_loras,
           "tokens": lora["tokens"], "tokens_per_s": _throughput(lora, args.clock),
           "ttft_p50_s": percentile(lora["ttfts"], 50), "ttft_p99_s": percentile(lora["ttfts"], 99),
           **{key: lora[key] for key in ("loads", "evictions", "disk_loads", "cpu_evictions")},
           "base_tokens_per_s": _throughput(base, args.clock),
           "base_ttft_p50_s": percentile(base["ttfts"], 50),
           "clock_seconds": {name: {"wall": r["seconds"], "process": r["cpu_seconds"]}
                             for name, r in (("engine", lora), ("engine_base", base))}}
    row["vs_base"] = row["tokens_per_s"] / row["base_tokens_per_s"]
    if peft is not None and spec.num_adapters:
        result = None
        for _ in range(args.repeats):
            result = _faster(result, peft.run(requests, desc=f"{spec.name}: PEFT"), args.clock)
        row["peft_tokens_per_s"] = _throughput(result, args.clock)
        row["peft_ttft_p50_s"] = percentile(result["ttfts"], 50)
        row["clock_seconds"]["peft"] = {"wall": result["seconds"], "process": result["cpu_seconds"]}
        row["vs_peft"] = row["tokens_per_s"] / row["peft_tokens_per_s"]
        # sanity check, not a speed: share of requests whose greedy tokens equal PEFT's
        row["same_as_peft"] = sum(lora["token_ids"][r.request_id] == result["token_ids"][r.request_id]
                                  for r in requests) / len(requests)
    del runner
    return row


CONTENTION_COLUMNS = [("threads", "threads", "d"), ("competing", "competing busy processes", "d"),
                      ("engine_tokens_per_s", "engine tok/s", ".1f"), ("hf_tokens_per_s", "transformers tok/s", ".1f"),
                      ("vs_hf", "engine / transformers", ".2f"), ("engine_slowdown", "engine slowdown", ".2f"),
                      ("hf_slowdown", "transformers slowdown", ".2f")]


@contextlib.contextmanager
def busy_process(enabled: bool):
    """A subprocess spinning on this process's last CPU while the block runs (nothing if not enabled)."""
    if not enabled:
        yield
        return
    cpu = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)  # spinning before the timed run starts
        yield
    finally:
        proc.kill()
        proc.wait()


def contention_rows(model_dir: str, vocab_size: int, args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Engine vs transformers on one batch of base-model requests, without and with a competing busy
    process, at the engine's default thread count and at 1 (wall-clock tok/s, best of --repeats)."""
    from lora_runner.device import available_cpu_cores

    spec = WorkloadSpec(num_requests=args.num_requests or 32, num_adapters=0, prompt_len=(8, 32), output_len=(8, 24))
    requests = make_workload(spec, vocab_size)
    warmup = make_workload(WorkloadSpec(num_requests=2, num_adapters=0, seed=99, prompt_len=(4, 8),
                                        output_len=(2, 2)), vocab_size)
    hf = PeftRunner(model_dir, [], device, dtype)  # no adapters: plain transformers generate()
    rows = []
    for threads in dict.fromkeys((available_cpu_cores(), 1)):
        engine = EngineRunner(model_dir, [], spec, args.rank, str(device), max_model_len=128,
                              max_batched_tokens=2048, cpu_threads=threads)  # sets torch's threads: both use them
        engine.run(warmup, False, "warm-up")
        hf.run(warmup, "warm-up")
        for competing in (0, 1):
            best_engine = best_hf = None
            with busy_process(competing > 0):
                for _ in range(args.repeats):
                    label = f"{threads} threads, {competing} busy"
                    best_engine = _faster(best_engine, engine.run(requests, False, f"engine, {label}"), "wall")
                    best_hf = _faster(best_hf, hf.run(requests, f"transformers, {label}"), "wall")
            rows.append({"threads": threads, "competing": competing,
                         "engine_tokens_per_s": _throughput(best_engine, "wall"),
                         "hf_tokens_per_s": _throughput(best_hf, "wall"),
                         "clock_seconds": {name: {"wall": r["seconds"], "process": r["cpu_seconds"]}
                                           for name, r in (("engine", best_engine), ("transformers", best_hf))}})
            rows[-1]["vs_hf"] = rows[-1]["engine_tokens_per_s"] / rows[-1]["hf_tokens_per_s"]
        calm, busy = rows[-2], rows[-1]
        busy["engine_slowdown"] = calm["engine_tokens_per_s"] / busy["engine_tokens_per_s"]
        busy["hf_slowdown"] = calm["hf_tokens_per_s"] / busy["hf_tokens_per_s"]
        del engine
    return rows


def _throughput(result: dict, clock: str) -> float:
    """Output tokens per wall-clock second, or per CPU second of this process (clock="process")."""
    return result["tokens"] / result["seconds" if clock == "wall" else "cpu_seconds"]


def _faster(best: dict | None, result: dict, clock: str) -> dict:
    """The run with the higher throughput, but the first run's adapter counters (later runs start
    with adapters already cached)."""
    if best is None:
        return result
    winner = dict(result if _throughput(result, clock) > _throughput(best, clock) else best)
    winner.update({key: best[key] for key in ("loads", "evictions", "disk_loads", "cpu_evictions")
                   if key in best})
    return winner


def _policies(text: str) -> list[str]:
    from lora_runner.core.fairness import POLICIES

    policies = text.split(",")
    if not policies or any(p not in POLICIES for p in policies):
        raise argparse.ArgumentTypeError(f"policies must be among {POLICIES}, got {text!r}")
    return policies


FAIRNESS_COLUMNS = [("policy", "policy", ""), ("heavy_requests", "heavy requests", "d"),
                    ("light_requests", "light requests each", "d"), ("share_heavy", "heavy share", ".1%"),
                    ("share_light_1", "light-1 share", ".1%"), ("share_light_2", "light-2 share", ".1%"),
                    ("window_steps", "window steps", "d"), ("us_per_step", "schedule() us/step", ".0f")]


def fairness_row(policy: str, light_requests: int = 50, max_num_seqs: int = 8, seed: int = 0) -> dict:
    """Skewed load through the scheduler alone: tenant "heavy" sends 10x the requests of "light-1"
    and "light-2", interleaved 10:1:1, all at once; each tenant has its own LoRA, 2 slots. Shares
    of weighted served tokens count the steps at whose start every tenant still had a waiting request."""
    import numpy as np

    from lora_runner.core.block_manager import BlockManager
    from lora_runner.core.fairness import VirtualTokenCounter, served_tokens
    from lora_runner.sampling_params import SamplingParams
    from lora_runner.core.scheduler import Scheduler
    from lora_runner.core.request import Request

    rng = np.random.default_rng(seed)
    vtc = VirtualTokenCounter()
    sched = Scheduler(BlockManager(4096, 16), max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_loras=2,
                      adapter_state=lambda ref: "ready", policy=policy, fairness=vtc)
    tenants = (["heavy"] * 10 + ["light-1", "light-2"]) * light_requests
    for i, tenant in enumerate(tenants):
        prompt = rng.integers(4, 1000, size=int(rng.integers(8, 33))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(8, 25)), ignore_eos=True)
        sched.add(Request(f"{tenant}-{i}", prompt, params, arrival=i, lora_ref=tenant, tenant=tenant))
    served, window_steps, seconds, steps = dict.fromkeys(("heavy", "light-1", "light-2"), 0.0), 0, 0.0, 0
    while sched.has_unfinished():
        backlogged = {r.tenant for r in sched.waiting} == set(served)
        start = time.perf_counter()
        out = sched.schedule()
        seconds += time.perf_counter() - start
        steps += 1
        for s in out.scheduled:
            if backlogged:
                served[s.request.tenant] += vtc.cost(*served_tokens(s.request, s.num_new_tokens, s.samples))
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                s.request.token_ids.append(5)
                if s.request.num_output_tokens >= s.request.params.max_tokens:
                    s.request.finish("length")
                    sched.remove(s.request)
        window_steps += backlogged
    total = sum(served.values())
    return {"policy": policy, "heavy_requests": 10 * light_requests, "light_requests": light_requests,
            **{f"share_{t.replace('-', '_')}": served[t] / total for t in served},
            "window_steps": window_steps, "us_per_step": 1e6 * seconds / steps}


def plot(rows: list[dict], path: Path) -> bool:
    """Bar chart of output tokens/s per workload; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed (pip install -e '.[bench]'): no plot")
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    width = 0.27
    for k, (key, label) in enumerate([("tokens_per_s", "engine + adapters"),
                                      ("base_tokens_per_s", "engine, no adapters"),
                                      ("peft_tokens_per_s", "PEFT adapter_names")]):
        ax.bar([i + (k - 1) * width for i in range(len(rows))],
               [row.get(key) or 0.0 for row in rows], width, label=label)
    ax.set_xticks(range(len(rows)), [row["workload"] for row in rows], rotation=30, ha="right")
    ax.set_ylabel("output tokens/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU mode: ~100M-parameter model, < 5 min")
    p.add_argument("--model", help="local model dir to use instead of a random Llama-shaped model")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of the random adapters")
    p.add_argument("--num-requests", type=int, help="requests per workload (default 32 quick, 256 full)")
    p.add_argument("--device", default="auto")
    p.add_argument("--skip-peft", action="store_true", help="do not run the PEFT baseline")
    p.add_argument("--repeats", type=int, default=1, help="runs per configuration; the fastest counts")
    p.add_argument("--clock", choices=("wall", "process"),
                   help="tokens/s per wall-clock second, or per CPU second of this process (immune to "
                        "other processes on a shared CPU machine); default: process for --quick on CPU")
    p.add_argument("--threads", type=int,
                   help="torch CPU threads; default: 1 for --quick on CPU (2 threads on 2 busy cores "
                        "spin-wait and run several times slower), else torch's choice")
    p.add_argument("--policy", default="fair", type=_policies,
                   help="comma-separated scheduling policies (fair, fcfs); each workload runs under each")
    p.add_argument("--workloads", type=lambda text: [int(i) for i in text.split(",") if i],
                   help="comma-separated indices into the workload grid (default: all; \"\": none)")
    p.add_argument("--contention", action="store_true",
                   help="add the engine-vs-transformers table without and with a competing busy process")
    p.add_argument("--fairness", action="store_true",
                   help="add the skewed-load fairness table (scheduler only, no model; seconds)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="N > 1 adds a table: tp=1 against tp=N with the same total threads (wall clock)")
    p.add_argument("--tp-backend", choices=("mp", "ray"), default="mp",
                   help="the executor backend of the tp=N engine (ray: a local Ray instance is started)")
    p.add_argument("--out-dir", default="results")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Run the benchmark; returns the table rows (also written as JSON)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    quick_cpu = args.quick and device.type == "cpu"
    args.clock = args.clock or ("process" if quick_cpu else "wall")
    if args.threads or quick_cpu:
        torch.set_num_threads(args.threads or 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    num_requests = args.num_requests or (32 if args.quick else 256)
    specs = (quick_workloads if args.quick else full_workloads)(num_requests)
    specs = [specs[i] for i in args.workloads] if args.workloads is not None else specs
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_engine-") as tmp:
        from transformers import AutoConfig, AutoModelForCausalLM

        if args.model:
            model_dir = args.model
            base_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        else:
            model_dir = str(Path(tmp) / "model")
            base_model = save_random_model(Path(model_dir), QUICK_SHAPE if args.quick else FULL_SHAPE,
                                           dtype=dtype)
        vocab_size = AutoConfig.from_pretrained(model_dir).vocab_size
        num_adapters = max([s.num_adapters for s in specs] + [TP_ADAPTERS if args.tensor_parallel_size > 1 else 0])
        adapter_paths = save_random_adapters(base_model, Path(tmp) / "adapters", num_adapters, args.rank)
        del base_model
        peft = None if args.skip_peft else PeftRunner(model_dir, adapter_paths, device, dtype)
        rows = [run_workload(spec, model_dir, adapter_paths, args, peft, vocab_size, policy)
                for spec in tqdm(specs, desc="workloads") for policy in args.policy]
        contention = contention_rows(model_dir, vocab_size, args, device, dtype) if args.contention else None
        args.device_name = str(device)
        tensor_parallel = (tp_rows(EngineRunner, model_dir, adapter_paths, vocab_size, args,
                                   args.threads or torch.get_num_threads())
                           if args.tensor_parallel_size > 1 else None)
    report = {"mode": "quick" if args.quick else "full", "model": args.model or "random",
              "rank": args.rank, "repeats": args.repeats, "clock": args.clock,
              "machine": machine_description(str(device)), "seconds": time.perf_counter() - started,
              "rows": rows}
    if args.fairness:
        report["fairness"] = [fairness_row(policy) for policy in args.policy]
    if contention is not None:
        report["contention"] = contention
    if tensor_parallel is not None:
        report["tensor_parallel"] = tensor_parallel
    path = write_report(report, args.out_dir, f"bench_engine-{report['mode']}")
    plot(rows, path.with_suffix(".png"))
    print(markdown_table(rows, COLUMNS))
    if args.fairness:
        print("\nSkewed load, scheduler only: share of weighted served tokens while all tenants are backlogged")
        print(markdown_table(report["fairness"], FAIRNESS_COLUMNS))
    if contention is not None:
        print("\nBatch of base-model requests, engine vs transformers generate(), wall-clock tok/s; slowdown: "
              "without / with the competing process")
        print(markdown_table(contention, CONTENTION_COLUMNS))
    if tensor_parallel is not None:
        print(f"\nOne batch (each request on one of 4 LoRAs), tp=1 against tp={args.tensor_parallel_size} with the same total "
              "threads, wall-clock tok/s")
        print(markdown_table(tensor_parallel, TP_COLUMNS))
    print(f"\ntok/s per {args.clock} second; {report['machine']}\n"
          f"total {report['seconds']:.0f} s; written {path}")
    return rows


if __name__ == "__main__":
    main()
