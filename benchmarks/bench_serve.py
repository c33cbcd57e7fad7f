"""Serving benchmark: Poisson arrivals through the OpenAI HTTP server vs the same engine in-process.

For each (adapter popularity, request rate) the same seeded workload (benchmarks/common.py) runs:
  http        `python -m lora_runner.serve` in its own process, driven by the async `openai` client
              (streamed completions, greedy, EOS ignored, arrivals replayed in real time)
  in-process  LLMEngine.add_request/step in this process on the same model and adapters
and the table shows output tok/s, TTFT and ITL p50/p99 of both and the HTTP layer's cost as ratios.
With --replicas N (N > 1, needs the `ray` extra) the same workload also runs through
`lora-runner serve --num-replicas N` (Ray Serve, adapter-affinity routing): its tok/s, TTFT/ITL and
the adapter loads per replica (from its /metrics) join the table.
One more workload gives every tenant (adapter) its own system prompt of --shared-prefix-len tokens
(0: none) at the first rate; it also runs through a second server started with
--no-enable-prefix-caching, and its TTFT without the prefix cache and the gain join the table.

    python benchmarks/bench_serve.py --quick       # CPU, tiny random model, about 2 minutes
    python benchmarks/bench_serve.py               # GPU, ~100M-parameter random model

Writes results/bench_serve-<mode>-<time>.json (and a .png of latency vs rate with the `bench` extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (BenchRequest, ModelShape, WorkloadSpec, machine_description, make_workload, markdown_table, percentile,
                    save_random_adapters, save_random_model)

logger = logging.getLogger("bench_serve")

REPO = Path(__file__).resolve().parents[1]
QUICK_SHAPE = ModelShape(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4, num_kv_heads=2,
                         vocab_size=4096)
FULL_SHAPE = ModelShape(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4)
COLUMNS = [("workload", "workload", ""), ("rate", "req/s", ".0f"),
           ("http_tokens_per_s", "HTTP tok/s", ".1f"), ("engine_tokens_per_s", "engine tok/s", ".1f"),
           ("http_ttft_p50_s", "HTTP TTFT p50", ".3f"), ("http_ttft_p99_s", "HTTP TTFT p99", ".3f"),
           ("engine_ttft_p50_s", "engine TTFT p50", ".3f"), ("http_itl_p50_s", "HTTP ITL p50", ".4f"),
           ("http_itl_p99_s", "HTTP ITL p99", ".4f"), ("engine_itl_p50_s", "engine ITL p50", ".4f"),
           ("throughput_ratio", "HTTP/engine tok/s", ".2f"), ("ttft_ratio", "HTTP/engine TTFT p50", ".2f")]
RAY_COLUMNS = [("ray_tokens_per_s", "Ray tok/s", ".1f"), ("ray_ttft_p50_s", "Ray TTFT p50", ".3f"),
               ("ray_ttft_p99_s", "Ray TTFT p99", ".3f"), ("ray_itl_p50_s", "Ray ITL p50", ".4f"),
               ("ray_itl_p99_s", "Ray ITL p99", ".4f"), ("ray_loads_per_replica", "Ray loads/replica", "")]
PREFIX_COLUMNS = [("nocache_ttft_p50_s", "HTTP TTFT p50 no cache", ".3f"),
                  ("nocache_tokens_per_s", "HTTP tok/s no cache", ".1f"),
                  ("prefix_cache_ttft_gain", "TTFT no cache/cache", ".2f")]


def _summary(prefix: str, tokens: int, seconds: float, ttfts: list[float], itls: list[float]) -> dict:
    return {f"{prefix}_tokens_per_s": tokens / seconds, f"{prefix}_ttft_p50_s": percentile(ttfts, 50),
            f"{prefix}_ttft_p99_s": percentile(ttfts, 99), f"{prefix}_itl_p50_s": percentile(itls, 50),
            f"{prefix}_itl_p99_s": percentile(itls, 99)}


# ----------------------------------------------------------------------------- through HTTP
async def _http_request(client, request, model: str, start: float, ttfts: list, itls: list) -> int:
    await asyncio.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    arrived = time.perf_counter()
    stream = await client.completions.create(model=model, prompt=list(request.prompt_token_ids), stream=True,
                                             max_tokens=request.max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True})
    last, count = None, 0
    async for chunk in stream:
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        ttfts.append(now - arrived) if last is None else itls.append(now - last)
        last, count = now, count + 1
    return request.max_tokens


async def _run_http(base_url: str, requests, names: list[str], prefix: str = "http") -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0, timeout=600)
    for name in ["base", *names]:  # warm-up: first loads and first calls are not what we measure
        await client.completions.create(model=name, prompt=[5, 6, 7], max_tokens=2)
    ttfts, itls = [], []
    start = time.perf_counter()
    try:
        tokens = await asyncio.gather(*(_http_request(client, r, names[r.adapter] if r.adapter is not None else "base",
                                                      start, ttfts, itls) for r in requests))
    finally:
        await client.close()
    return _summary(prefix, sum(tokens), time.perf_counter() - start, ttfts, itls)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_dir: str, adapters: list[Path], max_loras: int, device: str,
                 threads: int | None, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    """`python -m lora_runner.serve` on a free port; returns (process, base url) once /health answers."""
    import httpx

    port = _free_port()
    command = [sys.executable, "-m", "lora_runner.serve", model_dir, "--port", str(port), "--device", device,
               "--served-model-name", "base", "--max-loras", str(max_loras), "--max-lora-rank", "16",
               "--log-level", "warning", "--lora-modules", *[f"a{i}={p}" for i, p in enumerate(adapters)], *extra]
    env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    process = subprocess.Popen(command, cwd=REPO, env=env)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(base_url + "/health").status_code == 200:
                return process, base_url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the server did not start")


# ----------------------------------------------------------------------------- in-process engine
def run_engine(engine, requests, adapters: list[Path]) -> dict:
    """Replay the arrivals into LLMEngine.add_request and step until everything finished."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    pending = sorted(requests, key=lambda r: r.arrival_s)
    arrived, last, ttfts, itls, seen = {}, {}, [], [], {}
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            r = pending.pop(0)
            lora = LoRARequest(f"a{r.adapter}", str(adapters[r.adapter])) if r.adapter is not None else None
            engine.add_request(r.request_id, list(r.prompt_token_ids),
                               SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True), lora)
            arrived[r.request_id] = time.perf_counter()
        if not engine.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, pending[0].arrival_s - now)))
            continue
        for output in engine.step():
            t, n = time.perf_counter(), len(output.outputs[0].token_ids)
            if n and seen.get(output.request_id, 0) < n:
                ttfts.append(t - arrived[output.request_id]) if output.request_id not in last else \
                    itls.append(t - last[output.request_id])
                last[output.request_id], seen[output.request_id] = t, n
    return _summary("engine", sum(r.max_tokens for r in requests), time.perf_counter() - start, ttfts, itls)


# ----------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CPU-sized model and workload")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=None)
    parser.add_argument("--popularities", nargs="+", default=["uniform", "zipf"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=str(REPO / "results"))
    parser.add_argument("--replicas", type=int, default=1, help="> 1: also run through Ray Serve with N replicas")
    parser.add_argument("--shared-prefix-len", type=int, default=None,
                        help="system prompt tokens per tenant in the shared-prefix workload (0: skip it; "
                             "default 256 with --quick, else 512)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        import torch

        torch.set_num_threads(1)
    num_requests = args.num_requests or (32 if args.quick else 256)
    rates = args.rates or ([4.0, 16.0] if args.quick else [4.0, 16.0, 64.0])
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    if args.shared_prefix_len is None:
        args.shared_prefix_len = 256 if args.quick else 512
    rows = run_grid(shape, num_requests, args, rates)
    print(markdown_table(rows, COLUMNS + (RAY_COLUMNS if args.replicas > 1 else [])
                         + (PREFIX_COLUMNS if args.shared_prefix_len else [])))
    save(rows, args, shape)


def run_grid(shape: ModelShape, num_requests: int, args, rates: list[float]) -> list[dict]:
    """Every (popularity, rate): the HTTP run, then the in-process run."""
    from lora_runner import LLMEngine

    specs = [WorkloadSpec(num_requests=num_requests, num_adapters=args.num_adapters, popularity=p, arrival="poisson",
                          rate=rate, max_loras=args.max_loras, prompt_len=(8, 48), output_len=(16, 48))
             for p in args.popularities for rate in rates]
    if args.shared_prefix_len:
        specs.append(WorkloadSpec(num_requests=num_requests, num_adapters=args.num_adapters, popularity="uniform",
                                  arrival="poisson", rate=rates[0], max_loras=args.max_loras, prompt_len=(8, 48),
                                  output_len=(16, 48), shared_prefix_len=args.shared_prefix_len))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "model", shape, initializer_range=0.2)
        adapters = save_random_adapters(model, Path(tmp) / "adapters", args.num_adapters, rank=16, progress=False)
        names = [f"a{i}" for i in range(len(adapters))]
        threads = 1 if args.quick else None  # --quick: one thread per process, as bench_engine, on a shared CPU
        process, base_url = start_server(str(Path(tmp) / "model"), adapters, args.max_loras, args.device, threads)
        try:
            http = [asyncio.run(_run_http(base_url, make_workload(s, shape.vocab_size), names)) for s in specs]
        finally:
            process.terminate()
            process.wait(60)
        nocache = run_without_prefix_cache(str(Path(tmp) / "model"), adapters, args, specs, shape, names, threads)
        ray = run_ray(str(Path(tmp) / "model"), adapters, args, specs, shape, names) if args.replicas > 1 else None
        engine = LLMEngine(str(Path(tmp) / "model"), max_loras=args.max_loras, max_lora_rank=16, device=args.device)
        try:
            warm_up = [BenchRequest(f"warm-{i}", (5, 6, 7), 2, i, 0.0) for i in range(len(adapters))]
            run_engine(engine, warm_up, adapters)
            for spec, http_row in zip(specs, http):
                row = {"workload": spec.name, "rate": spec.rate, **http_row, **(ray.pop(0) if ray else {}),
                       **run_engine(engine, make_workload(spec, shape.vocab_size), adapters)}
                row["throughput_ratio"] = row["http_tokens_per_s"] / row["engine_tokens_per_s"]
                row["ttft_ratio"] = row["http_ttft_p50_s"] / row["engine_ttft_p50_s"]
                if spec.shared_prefix_len:
                    row.update(nocache.pop(0))
                    row["prefix_cache_ttft_gain"] = row["nocache_ttft_p50_s"] / row["http_ttft_p50_s"]
                rows.append(row)
        finally:
            engine.close()
    return rows


def run_without_prefix_cache(model_dir: str, adapters: list[Path], args, specs, shape: ModelShape,
                             names: list[str], threads: int | None) -> list[dict]:
    """The shared-prefix workloads through a server started with --no-enable-prefix-caching."""
    shared = [s for s in specs if s.shared_prefix_len]
    if not shared:
        return []
    process, base_url = start_server(model_dir, adapters, args.max_loras, args.device, threads,
                                     ("--no-enable-prefix-caching",))
    try:
        return [asyncio.run(_run_http(base_url, make_workload(s, shape.vocab_size), names, prefix="nocache"))
                for s in shared]
    finally:
        process.terminate()
        process.wait(60)


def run_ray(model_dir: str, adapters: list[Path], args, specs, shape: ModelShape, names: list[str]) -> list[dict]:
    """The workloads through `serve --num-replicas N` (one CPU per replica); each row gets the
    adapter loads per replica that its workload caused."""
    import httpx

    extra = ("--num-replicas", str(args.replicas), "--replica-cpus", "1", "--max-cpu-loras", str(len(adapters)))
    process, base_url = start_server(model_dir, adapters, args.max_loras, args.device, 1 if args.quick else None, extra)
    rows = []
    try:
        for spec in specs:
            before = _loads_per_replica(httpx.get(base_url + "/metrics").text)
            row = asyncio.run(_run_http(base_url, make_workload(spec, shape.vocab_size), names, prefix="ray"))
            after = _loads_per_replica(httpx.get(base_url + "/metrics").text)
            row["ray_loads_per_replica"] = " ".join(str(int(after[r] - before.get(r, 0))) for r in sorted(after))
            rows.append(row)
    finally:
        process.terminate()
        process.wait(120)
    return rows


def _loads_per_replica(metrics: str) -> dict[str, float]:
    loads: dict[str, float] = {}
    for line in metrics.splitlines():
        if line.startswith("lora_runner_replica_adapter_loads_total{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            loads[replica] = loads.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return loads


def save(rows: list[dict], args, shape: ModelShape) -> None:
    """JSON of the rows and the machine; a PNG of TTFT/ITL p50 vs rate when matplotlib is installed."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_serve-{'quick' if args.quick else 'full'}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine_description(args.device), "shape": vars(shape)
                                                     if hasattr(shape, "__dict__") else str(shape), "rows": rows},
                                                    indent=2, default=str))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.info("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload in dict.fromkeys(r["workload"].rsplit(" ", 0)[0] for r in rows):
        mine = [r for r in rows if r["workload"] == workload]
        for key, style in (("http_ttft_p50_s", "o-"), ("engine_ttft_p50_s", "s--")):
            ax.plot([r["rate"] for r in mine], [r[key] for r in mine], style, label=f"{workload} {key[:-6]}")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("TTFT p50 (s)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"))
    logger.info("wrote %s.json and .png", stem)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
