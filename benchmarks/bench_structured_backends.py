"""The two structured-output backends (xgrammar, llguidance) on one schema corpus and one hostile grammar.

Each backend runs in a fresh process (so its memory is its own) on a real BPE vocabulary (SmolLM2's, 49k
tokens, as the GGUF tests cache it; --tokenizer for another tokenizer.json), through the engine's own
Backend interface (lora_runner.engine.structured):

- compile: CPU seconds to compile each schema of benchmarks/data/structured_schemas.json (88 schemas
  spanning JSONSchemaBench's features: $ref/$defs, anyOf/oneOf/allOf, patterns, formats, min/maxItems,
  additionalProperties, enums, nested arrays, recursion), p50 and max;
- mask: CPU milliseconds of each per-token mask while the schema's valid instance is fed token by token
  (the first mask apart: llguidance's compilation is lazy, so part of its work lands there), p50 / p99;
- memory: the bytes each compiled grammar counts in the tenant caches (Backend.size_of) and the process's
  RSS growth per compiled grammar (all kept alive), then per matcher;
- coverage: schemas that compile AND whose valid instance is accepted token by token, then the end token;
- ambiguous: `s ::= s s | "a" | "b"` fed random a/b tokens: the mask time per token as it grows, and where
  the backend's own per-step bound stops it (llguidance; xgrammar has none: the engine's CPU-time budget).

    python benchmarks/bench_structured_backends.py             # ~1-3 min on one CPU core
    python benchmarks/bench_structured_backends.py --mask-budget-ms 5 --ambiguous-tokens 150
    python benchmarks/bench_structured_backends.py --batch 8 32 64   # guidance: a step's rows one by one vs together

--batch: C matchers of the corpus filled as engine steps fill them, one by one (GuidanceMatcher.fill, as xgrammar
always does) and together (GuidanceBackend.fill_batch: llguidance's executor threads), each advanced by its
instance's next token between steps; wall and step-thread CPU milliseconds per step, p50 over 11 steps, and the
first step's wall time apart (fresh matchers: llguidance's lazy lexer work lands there).

CPU time (time.process_time of the worker), so other load on a shared host skews the numbers less. Prints a
markdown table with ratios vs xgrammar and writes results/bench_structured_backends-<time>.json.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from common import machine_description, markdown_table, percentile

BACKENDS = ("xgrammar", "guidance")
CORPUS = Path(__file__).parent / "data" / "structured_schemas.json"
AMBIGUOUS = 'root ::= s\ns ::= s s | "a" | "b"'
SMOLLM2 = "~/.cache/lora-runner/test/gguf/SmolLM2-*/tokenizer.json"


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allowed(bitmask: torch.Tensor, token_id: int) -> bool:
    return bool(bitmask[0, token_id // 32] >> (token_id % 32) & 1)


def feed(backend, compiled, token_ids: list[int], eos: int, vocab: int) -> dict:
    """Feed `token_ids` then the end token through a fresh matcher, timing each mask (CPU ms)."""
    matcher = backend.matcher(compiled)
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)  # [1, W]
    masks_ms, accepted = [], True
    for token_id in [*token_ids, eos]:
        start = time.process_time()
        matcher.fill(bitmask, 0)
        masks_ms.append(1000 * (time.process_time() - start))
        if not allowed(bitmask, token_id) or not matcher.accept_token(token_id):
            accepted = False
            break
    return {"accepted": accepted and matcher.is_terminated(), "masks_ms": masks_ms, "matcher": matcher}


def corpus_run(backend, tokenizer, corpus: list[dict], eos: int, vocab: int) -> dict:
    """Compile every schema, then feed every valid instance; the per-schema results and the memory."""
    rss_start, compiled_all, rows = rss_bytes(), [], []
    for entry in corpus:
        start = time.process_time()
        try:
            compiled, error = backend.compile("json", json.dumps(entry["schema"])), None
        except Exception as exc:  # noqa: BLE001 - a schema a backend cannot read counts against its coverage
            compiled, error = None, str(exc).splitlines()[0][:160]
        rows.append({"name": entry["name"], "compile_s": time.process_time() - start, "error": error,
                     "bytes": backend.size_of(compiled) if compiled is not None else None})
        compiled_all.append(compiled)
    rss_compiled = rss_bytes()
    matchers = []
    for entry, row, compiled in zip(corpus, rows, compiled_all):
        if compiled is None:
            row["accepted"] = False
            continue
        text = json.dumps(entry["instance"], separators=(",", ":"), ensure_ascii=False)
        result = feed(backend, compiled, tokenizer.encode(text, add_special_tokens=False), eos, vocab)
        matchers.append(result.pop("matcher"))
        row.update(accepted=result["accepted"], first_mask_ms=result["masks_ms"][0], masks_ms=result["masks_ms"][1:])
    num_compiled = sum(c is not None for c in compiled_all)
    return {"rows": rows, "rss_per_grammar": (rss_compiled - rss_start) / max(1, num_compiled),
            "rss_per_matcher": (rss_bytes() - rss_compiled) / max(1, len(matchers))}


def ambiguous_run(backend, tokenizer, vocab: int, num_tokens: int) -> dict:
    """Random a/b tokens through `s ::= s s | "a" | "b"`: each mask's CPU ms, and what stopped it."""
    matcher = backend.matcher(backend.compile("grammar", AMBIGUOUS))
    ab_tokens = [i for i in range(vocab) if tokenizer.decode([i]) and set(tokenizer.decode([i])) <= {"a", "b"}]
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)  # [1, W]
    rng, masks_ms, stopped = random.Random(0), [], None
    for _ in range(num_tokens):
        start = time.process_time()
        matcher.fill(bitmask, 0)
        masks_ms.append(1000 * (time.process_time() - start))
        if matcher.step_error() is not None:
            stopped = matcher.step_error().splitlines()[0][:120]
            break
        assert matcher.accept_token(rng.choice(ab_tokens))
    return {"masks_ms": masks_ms, "tokens": len(masks_ms), "stopped_by": stopped}


def batch_run(tokenizer_file: str, sizes: list[int], steps: int = 12) -> list[dict]:
    """Per C in `sizes`: `steps` engine steps of C guidance rows (corpus schemas, each advanced by its instance's
    next token after every step: a fresh mask each time) filled one by one and in one batch, on two copies of the
    same matchers; wall and step-thread CPU ms per step, p50."""
    from transformers import PreTrainedTokenizerFast

    from lora_runner.engine.structured.guidance_backend import GuidanceBackend

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids("<|endoftext|>") or 0
    backend = GuidanceBackend(tokenizer, vocab, {eos})
    prepared = []  # (compiled, its instance's tokens), instances of more than `steps` tokens
    for entry in json.loads(CORPUS.read_text()):
        ids = tokenizer.encode(json.dumps(entry["instance"], separators=(",", ":")), add_special_tokens=False)
        if len(ids) <= steps:
            continue
        try:
            compiled = backend.compile("json", json.dumps(entry["schema"]))
        except Exception:  # noqa: BLE001 - a schema it cannot read is left out
            continue
        probe = backend.matcher(compiled)
        if all(probe.accept_token(token) for token in ids[:steps]):  # (and one whose instance it refuses)
            prepared.append((compiled, ids))
    rows = []
    for size in sizes:
        chosen = [prepared[i % len(prepared)] for i in range(size)]
        matchers = {mode: [backend.matcher(compiled) for compiled, _ in chosen] for mode in ("serial", "batch")}
        bitmask = torch.zeros((size, (vocab + 31) // 32), dtype=torch.int32)  # [C, W]
        timings = {"serial": [], "batch": []}
        for step in range(steps):
            for mode, ms in matchers.items():
                wall, cpu = time.perf_counter(), time.thread_time()
                if mode == "serial":
                    for index, matcher in enumerate(ms):
                        matcher.fill(bitmask, index)
                else:
                    backend.fill_batch([(matcher, index) for index, matcher in enumerate(ms)], bitmask)
                timings[mode].append((1000 * (time.perf_counter() - wall), 1000 * (time.thread_time() - cpu)))
                for matcher, (_, ids) in zip(ms, chosen):
                    assert matcher.accept_token(ids[step])
        row = {"rows": size, "fill_threads": backend.fill_threads, "schemas": len(prepared)}
        for mode, samples in timings.items():  # the first step apart: fresh matchers' lazy lexer work lands there
            row[f"{mode}_first_wall_ms"] = samples[0][0]
            row[f"{mode}_wall_ms"] = percentile([w for w, _ in samples[1:]], 50)
            row[f"{mode}_cpu_ms"] = percentile([c for _, c in samples[1:]], 50)
        rows.append(row)
    return rows


def worker(name: str, tokenizer_file: str, ambiguous_tokens: int, mask_budget_ms: float) -> dict:
    """One backend's measurements, in this (fresh) process."""
    from transformers import PreTrainedTokenizerFast

    from lora_runner.engine.structured.grammar_compiler import make_backend

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)
    vocab, eos = len(tokenizer), tokenizer.convert_tokens_to_ids("<|endoftext|>") or 0
    rss_start, start = rss_bytes(), time.process_time()
    backend = make_backend(name, tokenizer, vocab, {eos}, mask_budget_ms / 1000)
    setup = {"setup_s": time.process_time() - start, "setup_rss": rss_bytes() - rss_start}
    corpus = json.loads(CORPUS.read_text())
    return {"backend": name, "vocab": vocab, **setup, **corpus_run(backend, tokenizer, corpus, eos, vocab),
            "ambiguous": ambiguous_run(backend, tokenizer, vocab, ambiguous_tokens)}


def summary(result: dict) -> dict:
    """The table's row of one backend."""
    rows = result["rows"]
    compiled = [r for r in rows if r["error"] is None]
    masks = [ms for r in compiled for ms in r.get("masks_ms", [])]
    ambiguous = result["ambiguous"]["masks_ms"]
    return {"backend": result["backend"], "coverage": sum(r["accepted"] for r in rows), "schemas": len(rows),
            "compiles": len(compiled), "setup_s": result["setup_s"],
            "compile_p50_ms": 1000 * percentile([r["compile_s"] for r in compiled], 50),
            "compile_max_ms": 1000 * max(r["compile_s"] for r in compiled),
            "first_mask_p50_ms": percentile([r["first_mask_ms"] for r in compiled if "first_mask_ms" in r], 50),
            "mask_p50_ms": percentile(masks, 50), "mask_p99_ms": percentile(masks, 99),
            "bytes_p50": percentile([r["bytes"] for r in compiled], 50),
            "rss_per_grammar": result["rss_per_grammar"], "rss_per_matcher": result["rss_per_matcher"],
            "ambiguous_tokens": result["ambiguous"]["tokens"], "ambiguous_max_ms": max(ambiguous),
            "ambiguous_100_ms": ambiguous[min(99, len(ambiguous) - 1)], "ambiguous_last_ms": ambiguous[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json (default: the cached SmolLM2 one)")
    parser.add_argument("--ambiguous-tokens", type=int, default=200)
    parser.add_argument("--mask-budget-ms", type=float, default=250.0,
                        help="EngineConfig.structured_outputs_mask_budget_ms (llguidance's limits follow it)")
    parser.add_argument("--batch", type=int, nargs="*", help="only the batch comparison, for these row counts")
    parser.add_argument("--worker", choices=BACKENDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokenizer_file = args.tokenizer or next(iter(glob.glob(os.path.expanduser(SMOLLM2))), None)
    if tokenizer_file is None:
        sys.exit("no tokenizer: pass --tokenizer path/to/tokenizer.json (the GGUF tests cache SmolLM2's)")
    if args.batch:
        rows = batch_run(tokenizer_file, args.batch)
        print(markdown_table(rows, [
            ("rows", "rows", "d"), ("fill_threads", "threads", "d"),
            ("serial_first_wall_ms", "one by one: 1st step wall ms", ".2f"), ("serial_wall_ms", "wall ms p50", ".2f"),
            ("serial_cpu_ms", "step-thread CPU ms", ".2f"), ("batch_first_wall_ms", "batch: 1st step wall ms", ".2f"),
            ("batch_wall_ms", "wall ms p50", ".2f"), ("batch_cpu_ms", "step-thread CPU ms", ".2f")]))
        return
    if args.worker:
        torch.set_num_threads(1)
        print(json.dumps(worker(args.worker, tokenizer_file, args.ambiguous_tokens, args.mask_budget_ms)))
        return
    results = []
    for name in BACKENDS:
        command = [sys.executable, __file__, "--worker", name, "--tokenizer", tokenizer_file,
                   "--ambiguous-tokens", str(args.ambiguous_tokens), "--mask-budget-ms", str(args.mask_budget_ms)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = [summary(result) for result in results]
    base = rows[0]
    for row in rows:
        for key in ("compile_p50_ms", "compile_max_ms", "mask_p50_ms", "mask_p99_ms", "rss_per_grammar"):
            row[f"{key}_x"] = row[key] / base[key] if base[key] else float("nan")
    print(markdown_table(rows, [
        ("backend", "backend", "s"), ("coverage", "coverage", "d"), ("compiles", "compiles", "d"),
        ("setup_s", "setup s", ".2f"), ("compile_p50_ms", "compile p50 ms", ".2f"),
        ("compile_p50_ms_x", "x", ".2f"), ("compile_max_ms", "compile max ms", ".1f"),
        ("compile_max_ms_x", "x", ".2f"), ("first_mask_p50_ms", "1st mask p50 ms", ".3f"),
        ("mask_p50_ms", "mask p50 ms", ".3f"), ("mask_p50_ms_x", "x", ".2f"), ("mask_p99_ms", "mask p99 ms", ".3f"),
        ("mask_p99_ms_x", "x", ".2f"), ("bytes_p50", "counted bytes p50", ".0f"),
        ("rss_per_grammar", "RSS/grammar", ".0f"), ("rss_per_grammar_x", "x", ".2f"),
        ("rss_per_matcher", "RSS/matcher", ".0f"), ("ambiguous_tokens", "ambig. tokens", "d"),
        ("ambiguous_100_ms", "ambig. ms @100", ".1f"), ("ambiguous_max_ms", "ambig. max ms", ".1f")]))
    for result in results:
        failed = [(r["name"], r["error"] or "instance refused") for r in result["rows"] if not r["accepted"]]
        print(f"\n{result['backend']}: not covered ({len(failed)}): " + "; ".join(f"{n} ({e})" for n, e in failed))
        print(f"{result['backend']}: ambiguous grammar stopped by: {result['ambiguous']['stopped_by']}")
    out = Path("results") / f"bench_structured_backends-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "machine": machine_description("cpu"), "summary": rows,
                               "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
