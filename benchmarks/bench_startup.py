"""Start-up benchmark: time and memory of ``LLM(model)`` against transformers' ``from_pretrained``.

The model is SmolLM2-135M-shaped (30 layers, hidden 576, intermediate 1536, 9 heads / 3 KV heads,
vocabulary 49152, tied embeddings, 8192-token context) with random weights, saved with
save_pretrained into a temporary directory (no network). Every case runs in a fresh subprocess, so
imports, allocator state and page faults are those a new user's process sees:

  transformers          AutoModelForCausalLM.from_pretrained(dir).to(device)
  transformers + cache  the same, then a zero-filled KV cache for the reference workload
                        (--seqs sequences of --len tokens: K and V of every layer, the model's dtype)
  engine default        LLM(dir, device=device): the default settings
  engine explicit       LLM(dir, device=device, max_num_seqs=--seqs, max_model_len=--len)

Per case: import seconds; construction seconds (wall, and this process's CPU seconds: the machine
may be shared); RSS after construction above RSS after the imports; peak RSS (ru_maxrss); with
--generate (default on) the seconds (wall and CPU) and RSS after greedily generating 16 tokens for
--seqs random prompts of 32 tokens (the cache the engine touches shows up here). On CUDA also the peak of torch's
allocator. Construction time and RSS are the fastest / smallest of --repeats processes.

    python benchmarks/bench_startup.py                       # cpu (+ cuda when available)
    python benchmarks/bench_startup.py --device cpu --repeats 3
    python benchmarks/bench_startup.py --code-root /path/to/other/checkout   # before/after a change

--code-root puts another checkout's lora_runner / adapters / punica_kernels first on the children's
path (the model and the measuring code stay this file's). Writes results/bench_startup-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
CASES = ("transformers", "transformers + cache", "engine default", "engine explicit")
COLUMNS = [("case", "case", ""), ("device", "device", ""), ("load_s", "load s", ".2f"),
           ("load_cpu_s", "load CPU s", ".2f"), ("rss_load_mib", "RSS +load MiB", ".0f"),
           ("peak_rss_mib", "peak RSS MiB", ".0f"), ("vs_hf_time", "time vs HF", ".2f"),
           ("vs_hf_cache_time", "time vs HF+cache", ".2f"), ("vs_hf_cache_rss", "RSS vs HF+cache", ".2f"),
           ("generate_s", "generate s", ".2f"), ("generate_cpu_s", "generate CPU s", ".2f"),
           ("rss_generate_mib", "RSS +gen MiB", ".0f"),
           ("cuda_peak_mib", "CUDA peak MiB", ".0f")]
PROMPT_LEN, NEW_TOKENS = 32, 16

logger = logging.getLogger("bench_startup")


# ----------------------------------------------------------------------------- child process

def _rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def _prompts(num: int, vocab_size: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(4, vocab_size, size=(num, PROMPT_LEN)).tolist()


def _load_transformers(case: dict):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(case["model_dir"], dtype=torch.float32
                                                 if case["device"] == "cpu" else torch.bfloat16)
    model = model.to(case["device"]).eval()
    cache = None
    if case["case"] == "transformers + cache":
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        cache = torch.zeros(cfg.num_hidden_layers, 2, case["seqs"], case["len"], cfg.num_key_value_heads,
                            head_dim, dtype=model.dtype, device=case["device"])  # what the workload needs
    return model, cache


def _generate_transformers(model, prompts: list[list[int]]) -> None:
    import torch

    ids = torch.tensor(prompts, device=model.device)  # [B, PROMPT_LEN]: equal lengths, no padding
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                       min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


def _load_engine(case: dict):
    from lora_runner import LLM

    kwargs = {"device": case["device"]}
    if case["case"] == "engine explicit":
        kwargs.update(max_num_seqs=case["seqs"], max_model_len=case["len"])
    return LLM(case["model_dir"], **kwargs), None


def _generate_engine(llm, prompts: list[list[int]]) -> None:
    from lora_runner import SamplingParams

    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                 use_tqdm=False)


def child(case: dict) -> dict:
    """Measure one case in this (fresh) process; returns the figures."""
    start = time.perf_counter()
    import torch  # noqa: F401  (timed: every user pays it)
    import transformers  # noqa: F401

    engine = case["case"].startswith("engine")
    if engine:
        import lora_runner
    imported = time.perf_counter()
    rss_imported = _rss_mib()
    on_cuda = case["device"].startswith("cuda")
    if on_cuda:
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    model, _cache = (_load_engine if engine else _load_transformers)(case)
    if on_cuda:
        torch.cuda.synchronize()
    result = {"import_s": imported - start, "load_s": time.perf_counter() - wall_start,
              "load_cpu_s": time.process_time() - cpu_start, "rss_load_mib": _rss_mib() - rss_imported,
              "num_threads": torch.get_num_threads(),
              "code": str(Path(lora_runner.__file__).parent) if engine else None}
    if case["generate"]:
        vocab = model.engine.model_config.vocab_size if engine else model.config.vocab_size
        prompts = _prompts(case["seqs"], vocab)
        gen_start, gen_cpu_start = time.perf_counter(), time.process_time()
        (_generate_engine if engine else _generate_transformers)(model, prompts)
        result.update(generate_s=time.perf_counter() - gen_start, generate_cpu_s=time.process_time() - gen_cpu_start,
                      rss_generate_mib=_rss_mib() - rss_imported)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    if on_cuda:
        result["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    return result


# ----------------------------------------------------------------------------- parent

def run_case(case: dict, code_root: Path, timeout_s: float) -> dict:
    """One fresh interpreter for `case`; its JSON result line."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(code_root), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=env, cwd=code_root,
                          capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case['case']!r} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def best_of(results: list[dict]) -> dict:
    """Fastest construction and generation, smallest memory over repeated processes."""
    best = dict(results[0])
    for key in best:
        values = [r[key] for r in results if isinstance(r.get(key), (int, float))]
        if values and key != "num_threads":
            best[key] = min(values)
    best["repeats"] = results
    return best


def add_ratios(rows: list[dict]) -> None:
    """Each row's construction time and RSS against transformers' on the same device."""
    for row in rows:
        ref = {r["case"]: r for r in rows if r["device"] == row["device"]}
        hf, hf_cache = ref.get("transformers"), ref.get("transformers + cache")
        if hf:
            row["vs_hf_time"] = row["load_s"] / hf["load_s"]
        if hf_cache:
            row["vs_hf_cache_time"] = row["load_s"] / hf_cache["load_s"]
            row["vs_hf_cache_rss"] = row["rss_load_mib"] / max(hf_cache["rss_load_mib"], 1.0)


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="comma-separated devices (default: cpu, plus cuda when available)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per case; the best counts")
    p.add_argument("--seqs", type=int, default=8, help="reference workload: sequences (explicit max_num_seqs)")
    p.add_argument("--len", type=int, default=512, help="reference workload: tokens per sequence (max_model_len)")
    p.add_argument("--no-generate", dest="generate", action="store_false",
                   help="skip the small greedy generation after construction")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {CASES}")
    p.add_argument("--code-root", type=Path, default=REPO_ROOT,
                   help="checkout whose lora_runner the engine cases import (default: this one)")
    p.add_argument("--model-dir", type=Path, help="reuse (or create) the random model here")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child process")
    p.add_argument("--out-dir", default="results")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ensure_model(model_dir: Path) -> None:
    """Write the SmolLM2-135M-shaped random model (and a tokenizer) unless it is there already."""
    if (model_dir / "config.json").exists():
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import ModelShape, save_random_model  # benchmarks/common.py

    shape = ModelShape(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                       vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)
    save_random_model(model_dir, shape)


def main(argv=None) -> list[dict]:
    """Run every case in fresh processes; returns the rows (also written as JSON)."""
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return []
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import torch
    from tqdm.auto import tqdm

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import machine_description, markdown_table, write_report

    devices = args.device.split(",") if args.device else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    cases = args.cases.split(",")
    if any(c not in CASES for c in cases):
        raise SystemExit(f"--cases must be among {CASES}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_startup-") as tmp:
        model_dir = args.model_dir or Path(tmp) / "model"
        ensure_model(model_dir)
        rows = []
        jobs = [(device, name) for device in devices for name in cases]
        for device, name in tqdm(jobs, desc="cases"):
            case = {"case": name, "device": device, "model_dir": str(model_dir), "seqs": args.seqs,
                    "len": args.len, "generate": args.generate}
            results = [run_case(case, args.code_root.resolve(), args.timeout) for _ in range(args.repeats)]
            rows.append({"case": name, "device": device, **best_of(results)})
    add_ratios(rows)
    report = {"code_root": str(args.code_root.resolve()), "seqs": args.seqs, "len": args.len,
              "repeats": args.repeats, "machine": machine_description(devices[0]),
              "seconds": time.perf_counter() - started, "rows": rows}
    path = write_report(report, args.out_dir, "bench_startup")
    print(markdown_table(rows, COLUMNS))
    print(f"\nreference workload: {args.seqs} sequences x {args.len} tokens; best of {args.repeats} processes; "
          f"engine code from {args.code_root}\n{report['machine']}\nwritten {path}")
    return rows


if __name__ == "__main__":
    main()
