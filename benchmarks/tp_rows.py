"""The tensor-parallel table of bench_engine.py (--tensor-parallel-size N): tp=1 against tp=N, same threads.

One batch of requests, each on one of 4 LoRAs, served by an engine at tensor_parallel_size=1 with T torch
threads and by one at tensor_parallel_size=N whose ranks get T // N threads each (EngineConfig.cpu_threads
is split over the ranks), so both use the same total threads. Wall-clock tok/s and ms per engine step (a step's
time includes the message to the ranks and the collectives); the ratio is to tp=1.
"""

from __future__ import annotations

from common import WorkloadSpec, make_workload  # benchmarks/common.py

TP_COLUMNS = [("tensor_parallel_size", "tp", "d"), ("backend", "backend", ""),
              ("threads_per_rank", "threads/rank", "d"), ("tokens_per_s", "out tok/s", ".1f"),
              ("ms_per_step", "ms/step", ".1f"), ("steps", "steps", "d"), ("vs_tp1", "vs tp=1", ".2f")]
TP_ADAPTERS = 4


def tp_workload(num_requests: int) -> WorkloadSpec:
    """The batch both engines serve: every request on one of 4 LoRAs (4 slots), all arriving at once."""
    return WorkloadSpec(num_requests=num_requests, num_adapters=TP_ADAPTERS, popularity="uniform", max_loras=4,
                        prompt_len=(8, 32), output_len=(16, 32))


def tp_rows(runner_class, model_dir: str, adapter_paths: list, vocab_size: int, args, threads: int) -> list[dict]:
    """Rows for tp=1 and tp=args.tensor_parallel_size (best of args.repeats, wall clock). ``runner_class``:
    bench_engine.EngineRunner (passed in: it lives in the script)."""
    spec = tp_workload(args.num_requests or 16)
    requests = make_workload(spec, vocab_size)
    rows = []
    for size in (1, args.tensor_parallel_size):
        backend = "uni" if size == 1 else args.tp_backend
        runner = runner_class(model_dir, adapter_paths[:TP_ADAPTERS], spec, args.rank, str(args.device_name),
                              max_model_len=128, max_batched_tokens=512, cpu_threads=threads,
                              tensor_parallel_size=size, distributed_executor_backend=backend)
        try:
            # the same batch once untimed: every LoRA is then in the CPU cache, so no timed step waits on a disk
            # load (a step while every request waits is instant and would dilute ms/step)
            runner.run(requests, True, f"warm-up tp={size}")
            best = None
            for _ in range(args.repeats):
                result = runner.run(requests, True, f"tp={size}")
                best = result if best is None or result["seconds"] < best["seconds"] else best
        finally:
            runner.engine.close()
        rows.append({"tensor_parallel_size": size, "backend": backend, "threads_per_rank": max(1, threads // size),
                     "tokens_per_s": best["tokens"] / best["seconds"], "steps": best["steps"],
                     "ms_per_step": 1000.0 * best["seconds"] / best["steps"], "seconds": best["seconds"]})
    for row in rows:
        row["vs_tp1"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    return rows
