"""Host cost of one decode step, and engine decode speed against transformers' `generate`.

Two measurements, one torch thread, this process's CPU time (immune to other processes on a shared
machine):

  host ms/step   the tiny model (2 layers, hidden 64), N running requests all in decode, A
                 distinct adapters spread round-robin over them; median CPU milliseconds per
                 `LLMEngine.step()` for N in 1/16/64/256, A in 0/8/32 (--paths times several torch
                 LoRA strategies on alternating steps). "outside model" subtracts the CPU time of
                 the model's forward and logits (on CPU, torch op dispatch makes even this model
                 cost milliseconds; on a GPU with graphs that part is one replay): what is left is
                 scheduling, the persistent rows and batch upload, LoRA meta, sampling and output
                 processing.
  decode tok/s   the ~100M-parameter model of bench_engine --quick, one batch of equal-length
                 prompts, greedy, EOS ignored: the engine base-only and with 8 adapters, and
                 transformers' own `generate` on the same prompts (base), best of --repeats
                 interleaved runs; and PEFT's mixed-adapter `generate(adapter_names=...)` with the
                 same 8 adapters over the requests (the engine's LoRA baseline). Decode tokens/s
                 excludes the prefill: engine steps after every request has its first token; for
                 `generate`, (time of n new tokens - time of 1) for (n-1) tokens per row.
  prefill tok/s  the same model, 8 sequences of --prefill-tokens / 8 tokens prefilled in ONE engine
                 step (max_num_batched_tokens >= the total): the engine base-only and with 8
                 adapters (one per sequence, round-robin), PEFT's forward of the 8 sequences as one
                 batch with adapter_names (its mixed batch) and transformers' forward (base), both
                 keeping the last position's logits only, as the engine; best of --repeats, fresh
                 prompts every run (no prefix-cache hits), after one warm-up run each. "same first
                 token": the engine's greedy first tokens against the argmax of transformers' (base)
                 or PEFT's (8 adapters) last logits, a check of the LoRA prefill's numbers.

    python benchmarks/bench_step.py                 # all three, ~2 min on one CPU core
    python benchmarks/bench_step.py --skip-decode --skip-prefill   # host table only
    python benchmarks/bench_step.py --skip-host --skip-decode --prefill-tokens 4096
    python benchmarks/bench_step.py --profile 64/8  # also a cProfile summary of that row's steps
    python benchmarks/bench_step.py --paths auto segmented   # A/B of the torch LoRA strategies

Writes results/bench_step-<time>.json. Targets (issue 14): <= 1 ms host per step at 64 requests
with 8 adapters (on CPU the model's own forward is part of it); engine base >= generate; engine
with 8 adapters >= 0.9x engine base; issue 26 adds engine with 8 adapters >= 2x PEFT's mixed batch
(decode) and prefill with 8 adapters >= 0.85x engine base.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import logging
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from common import (ModelShape, machine_description, markdown_table,  # benchmarks/common.py
                    save_random_adapters, save_random_model, start_cpu_run, write_report)

logger = logging.getLogger("bench_step")

TINY_SHAPE = ModelShape(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                        num_kv_heads=2, vocab_size=256)
DECODE_SHAPE = ModelShape(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12,
                          num_kv_heads=4)  # bench_engine's QUICK_SHAPE, ~100M parameters
RANK = 16
PROMPT_LEN = 16
PROFILE_STEPS = 10  # profiled together: one step is too short for cProfile's resolution
PREFILL_SEQUENCES = 8  # the prefill table's batch: one sequence per adapter


def host_columns(paths: list[str]) -> list[tuple[str, str, str]]:
    """Table columns: host ms per step and the ratio to 0 adapters, per torch LoRA path."""
    columns = [("num_requests", "requests", "d"), ("num_adapters", "adapters", "d")]
    for path in paths:
        columns += [(f"host_ms_{path}", f"host ms/step ({path})", ".2f"),
                    (f"outside_model_ms_{path}", f"outside model ms ({path})", ".2f"),
                    (f"vs_no_adapters_{path}", f"vs 0 adapters ({path})", ".2f")]
    return columns


DECODE_COLUMNS = [("run", "run", ""), ("batch", "batch", "d"), ("new_tokens", "new tokens", "d"),
                  ("decode_tokens_per_s", "decode tok/s", ".1f"),
                  ("total_tokens_per_s", "total tok/s", ".1f"),
                  ("vs_generate", "decode vs generate", ".2f"),
                  ("vs_engine_base", "decode vs engine base", ".2f"),
                  ("vs_peft", "decode vs PEFT", ".2f")]

PREFILL_COLUMNS = [("run", "run", ""), ("sequences", "sequences", "d"), ("tokens", "tokens", "d"),
                   ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
                   ("vs_engine_base", "vs engine base", ".2f"),
                   ("vs_forward", "vs transformers forward", ".2f"), ("vs_peft", "vs PEFT", ".2f"),
                   ("same_first_token", "same first token", ".0%")]


def make_engine(model_dir: str, num_requests: int, max_loras: int, max_model_len: int,
                max_num_batched_tokens: int = 0, quantization: str | None = None):
    """An eager CPU engine sized for `num_requests` running requests (and at least
    `max_num_batched_tokens` tokens per step), its weights quantized online as `quantization` says."""
    from lora_runner import LLMEngine

    max_model_len = -(-max_model_len // 16) * 16  # whole KV blocks: the default budget rounds down
    return LLMEngine(model=model_dir, max_loras=max_loras, max_lora_rank=RANK,
                     max_cpu_loras=max(16, max_loras), device="cpu", dtype="float32",
                     max_num_seqs=num_requests, max_model_len=max_model_len,
                     max_num_batched_tokens=max(2048, num_requests * PROMPT_LEN, max_num_batched_tokens),
                     enforce_eager=True, quantization=quantization)


def add_requests(engine, adapter_paths: list[Path], num_requests: int, num_adapters: int,
                 max_tokens: int, vocab_size: int) -> None:
    """Equal-length prompts, adapters round-robin (request i uses adapter i % num_adapters)."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(num_requests):
        prompt = torch.randint(4, vocab_size, (PROMPT_LEN,), generator=gen).tolist()
        lora = (LoRARequest(f"adapter-{i % num_adapters:03d}", str(adapter_paths[i % num_adapters]))
                if num_adapters else None)
        engine.add_request(f"req-{i}", prompt, params, lora_request=lora)


def step_until_all_decoding(engine, num_requests: int) -> None:
    """Step until every request has its first token (prefill done, adapters resident)."""
    started = set()
    while len(started) < num_requests:
        started.update(out.request_id for out in engine.step() if out.outputs[0].token_ids)


def timed_decode_steps(engine, num_requests: int, num_steps: int) -> list[tuple[float, float]]:
    """(CPU seconds, of which in the model) of each of `num_steps` decode steps; every step must
    advance every request."""
    seconds = []
    with ModelClock(engine.runner.model) as clock:
        for _ in range(num_steps):
            clock.seconds = 0.0
            start = time.process_time()
            outputs = engine.step()
            seconds.append((time.process_time() - start, clock.seconds))
            assert len(outputs) == num_requests, f"a step advanced {len(outputs)} of {num_requests}"
    return seconds


class ModelClock:
    """Counts the CPU seconds spent in a model's forward and compute_logits while entered."""

    def __init__(self, model) -> None:
        self.model, self.seconds = model, 0.0

    def _timed(self, fn):
        def timed(*args, **kwargs):
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.process_time() - start
        return timed

    def __enter__(self) -> ModelClock:
        for name in ("forward", "compute_logits"):  # instance attributes shadow the methods
            setattr(self.model, name, self._timed(getattr(self.model, name)))
        return self

    def __exit__(self, *exc) -> None:
        for name in ("forward", "compute_logits"):
            delattr(self.model, name)


@contextlib.contextmanager
def torch_lora_path(path: str):
    """Force the torch LoRA path's strategy ("padded" / "segmented"); "auto" leaves its choice."""
    from punica_kernels import reference

    chooser = reference.use_padded
    if path != "auto":
        reference.use_padded = lambda *args: path == "padded"
    try:
        yield
    finally:
        reference.use_padded = chooser


def host_row(model_dir: str, adapter_paths: list[Path], num_requests: int, num_adapters: int,
             args, profile: bool) -> dict:
    """Median CPU ms per decode step at `num_requests` running requests over `num_adapters`
    adapters, for each torch LoRA path of args.paths (alternating steps of one engine, so a busy
    machine slows them alike)."""
    # requests whose adapter loaded first start decoding early: leave them room to go on
    max_tokens = (len(args.paths) + 1) * args.steps + PROFILE_STEPS + 16
    engine = make_engine(model_dir, num_requests, max(1, num_adapters), PROMPT_LEN + max_tokens)
    add_requests(engine, adapter_paths, num_requests, num_adapters, max_tokens,
                 TINY_SHAPE.vocab_size)
    step_until_all_decoding(engine, num_requests)
    timed_decode_steps(engine, num_requests, 2)  # warm-up
    seconds = {path: [] for path in args.paths}
    for _ in range(args.steps):
        for path in args.paths:
            with torch_lora_path(path):
                seconds[path] += timed_decode_steps(engine, num_requests, 1)
    row = {"num_requests": num_requests, "num_adapters": num_adapters, "steps": args.steps}
    for path in args.paths:
        row[f"host_ms_{path}"] = 1e3 * statistics.median(total for total, _ in seconds[path])
        row[f"outside_model_ms_{path}"] = 1e3 * statistics.median(total - model for total, model in seconds[path])
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        timed_decode_steps(engine, num_requests, PROFILE_STEPS)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        row["profile"] = text.getvalue()
    engine.close()
    return row


def host_table(tmp: Path, args) -> list[dict]:
    """Host ms/step for every (requests, adapters) pair of the grid."""
    model_dir = tmp / "tiny"
    base = save_random_model(model_dir, TINY_SHAPE, initializer_range=0.2)
    adapter_paths = save_random_adapters(base, tmp / "tiny-adapters", max(args.adapters), RANK,
                                         progress=False)
    rows = []
    for num_requests in args.requests:
        base_row = None
        for num_adapters in args.adapters:  # the first is 0 (main checks it): the base of the ratios
            profile = args.profile == f"{num_requests}/{num_adapters}"
            row = host_row(str(model_dir), adapter_paths, num_requests, num_adapters, args, profile)
            base_row = row if num_adapters == 0 else base_row
            for path in args.paths:
                row[f"vs_no_adapters_{path}"] = row[f"host_ms_{path}"] / base_row[f"host_ms_{path}"]
            rows.append(row)
            logger.info("host %d requests / %d adapters: %s ms (outside the model %s)", num_requests, num_adapters,
                        {path: round(row[f"host_ms_{path}"], 2) for path in args.paths},
                        {path: round(row[f"outside_model_ms_{path}"], 2) for path in args.paths})
    return rows


def engine_decode(model_dir: str, adapter_paths: list[Path], prompts: list[list[int]],
                  new_tokens: int, num_adapters: int, quantization: str | None = None) -> dict:
    """Engine decode and end-to-end tokens per CPU second for one batch of `prompts`."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    engine = make_engine(model_dir, len(prompts), max(1, num_adapters),
                         PROMPT_LEN + new_tokens + 8, quantization=quantization)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        lora = (LoRARequest(f"a{i % num_adapters}", str(adapter_paths[i % num_adapters]))
                if num_adapters else None)
        if lora is not None:
            engine.add_lora(lora)  # loaded before timing, as generate's weights are
        engine.add_request(f"r{i}", prompt, params, lora_request=lora)
    start = time.process_time()
    step_until_all_decoding(engine, len(prompts))
    prefill_done = time.process_time()
    tokens = {}
    while engine.has_unfinished_requests():
        tokens.update({out.request_id: out.outputs[0].token_ids for out in engine.step()})
    end = time.process_time()
    engine.close()
    assert all(len(t) == new_tokens for t in tokens.values())
    return {"decode_tokens_per_s": len(prompts) * (new_tokens - 1) / (end - prefill_done),
            "total_tokens_per_s": len(prompts) * new_tokens / (end - start),
            "token_ids": [tokens[f"r{i}"] for i in range(len(prompts))]}


@torch.inference_mode()
def generate_decode(model, prompts: list[list[int]], new_tokens: int, **extra) -> dict:
    """transformers `generate` (greedy, no padding: equal-length prompts) on the same batch;
    `extra` goes to generate (PEFT's adapter_names)."""
    input_ids = torch.tensor(prompts)  # [B, S]
    kwargs = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(input_ids), **extra)

    def run(n: int) -> tuple[float, torch.Tensor]:
        start = time.process_time()
        out = model.generate(input_ids, max_new_tokens=n, min_new_tokens=n, **kwargs)  # [B, S+n]
        return time.process_time() - start, out[:, input_ids.shape[1]:]

    first, _ = run(1)
    full, out = run(new_tokens)
    return {"decode_tokens_per_s": len(prompts) * (new_tokens - 1) / (full - first),
            "total_tokens_per_s": len(prompts) * new_tokens / full, "token_ids": out.tolist()}


def peft_with_adapters(model_dir: str, adapter_paths: list[Path]):
    """A fresh base (PEFT injects its layers into the model it wraps) with every adapter loaded
    as a0, a1, ... for mixed-adapter batches."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, str(adapter_paths[0]), adapter_name="a0")
    for i, path in enumerate(adapter_paths[1:], start=1):
        model.load_adapter(str(path), adapter_name=f"a{i}")
    return model.eval()


def _faster(best: dict | None, result: dict) -> dict:
    """The run with the higher decode tokens/s."""
    if best is None or result["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
        return result
    return best


def decode_table(tmp: Path, args) -> list[dict]:
    """Engine base, engine with 8 adapters and `generate` on one batch of the ~100M model."""
    from transformers import AutoModelForCausalLM

    model_dir = tmp / "decode"
    base = save_random_model(model_dir, DECODE_SHAPE)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(4, DECODE_SHAPE.vocab_size, (args.batch, PROMPT_LEN),
                            generator=gen).tolist()
    adapter_paths = save_random_adapters(base, tmp / "decode-adapters", 8, RANK, progress=False)
    del base
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    peft_model = peft_with_adapters(str(model_dir), adapter_paths)
    names = [f"a{i % len(adapter_paths)}" for i in range(len(prompts))]  # round-robin, as the engine's
    reference = engine_base = engine_lora = peft = None
    for _ in range(args.repeats):  # interleaved, best of N: a busy machine slows all four alike
        reference = _faster(reference, generate_decode(model, prompts, args.new_tokens))
        peft = _faster(peft, generate_decode(peft_model, prompts, args.new_tokens, adapter_names=names))
        engine_base = _faster(engine_base, engine_decode(str(model_dir), adapter_paths, prompts,
                                                         args.new_tokens, 0))
        engine_lora = _faster(engine_lora, engine_decode(str(model_dir), adapter_paths, prompts,
                                                         args.new_tokens, 8))
    del model, peft_model
    same = sum(a == b for a, b in zip(engine_base["token_ids"], reference["token_ids"]))
    rows = []
    for name, result in (("generate (base)", reference), ("engine base", engine_base),
                         ("engine 8 adapters", engine_lora), ("PEFT 8 adapters", peft)):
        rows.append({"run": name, "batch": args.batch, "new_tokens": args.new_tokens,
                     "decode_tokens_per_s": result["decode_tokens_per_s"],
                     "total_tokens_per_s": result["total_tokens_per_s"],
                     "vs_generate": result["decode_tokens_per_s"] / reference["decode_tokens_per_s"],
                     "vs_engine_base": (result["decode_tokens_per_s"]
                                        / engine_base["decode_tokens_per_s"]),
                     "vs_peft": result["decode_tokens_per_s"] / peft["decode_tokens_per_s"]})
    rows[1]["same_tokens_as_generate"] = same / len(prompts)
    return rows


def prefill_prompts(num_tokens: int, seed: int) -> list[list[int]]:
    """PREFILL_SEQUENCES fresh random prompts of num_tokens / PREFILL_SEQUENCES tokens each."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, DECODE_SHAPE.vocab_size, (PREFILL_SEQUENCES, num_tokens // PREFILL_SEQUENCES),
                         generator=gen).tolist()


class EnginePrefill:
    """One engine that prefills a batch of prompts in a single step, each sequence with its
    adapter (round-robin over `num_adapters`, loaded up front) or none."""

    def __init__(self, model_dir: str, adapter_paths: list[Path], num_tokens: int, num_adapters: int,
                 quantization: str | None = None):
        from adapters import LoRARequest

        self.engine = make_engine(model_dir, PREFILL_SEQUENCES, max(1, num_adapters),
                                  num_tokens // PREFILL_SEQUENCES + 8, max_num_batched_tokens=num_tokens,
                                  quantization=quantization)
        self.loras = [LoRARequest(f"a{i}", str(adapter_paths[i])) for i in range(num_adapters)]
        for lora in self.loras:
            self.engine.add_lora(lora)  # loaded before timing, as the forward's weights are
        self.runs = 0

    def run(self, prompts: list[list[int]]) -> tuple[float, list[int]]:
        """CPU seconds of the one step that prefills `prompts`, and the first token it samples
        for each."""
        from lora_runner import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        ids = [f"r{self.runs}-{i}" for i in range(len(prompts))]
        self.runs += 1
        for i, (request_id, prompt) in enumerate(zip(ids, prompts)):
            lora = self.loras[i % len(self.loras)] if self.loras else None
            self.engine.add_request(request_id, prompt, params, lora_request=lora)
        start = time.process_time()
        outputs = self.engine.step()
        seconds = time.process_time() - start
        first = {out.request_id: out.outputs[0].token_ids[0] for out in outputs if out.finished}
        assert first.keys() == set(ids), f"one step prefilled {len(first)} of {len(ids)} sequences"
        return seconds, [first[request_id] for request_id in ids]


@torch.inference_mode()
def forward_run(model, prompts: list[list[int]], **extra) -> tuple[float, list[int]]:
    """CPU seconds of one transformers forward over the prompts as a batch (last logits only, as
    the engine computes), and each prompt's greedy next token; `extra` goes to the forward
    (PEFT's adapter_names)."""
    input_ids = torch.tensor(prompts)  # [B, S]
    start = time.process_time()
    logits = model(input_ids, attention_mask=torch.ones_like(input_ids), logits_to_keep=1, **extra).logits
    seconds = time.process_time() - start
    return seconds, logits[:, -1].argmax(-1).tolist()  # [B]


def prefill_table(tmp: Path, args) -> list[dict]:
    """Prefill tokens/s of one step of PREFILL_SEQUENCES sequences: engine base and with 8 adapters,
    transformers' forward and PEFT's mixed-adapter forward on the same batch."""
    from transformers import AutoModelForCausalLM

    model_dir, adapters_dir = tmp / "decode", tmp / "decode-adapters"
    if not model_dir.exists():  # --skip-decode: the decode table's model and adapters, made here
        base = save_random_model(model_dir, DECODE_SHAPE)
        save_random_adapters(base, adapters_dir, 8, RANK, progress=False)
        del base
    adapter_paths = sorted(adapters_dir.glob("adapter-*"))
    num_tokens = args.prefill_tokens // PREFILL_SEQUENCES * PREFILL_SEQUENCES
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    peft_model = peft_with_adapters(str(model_dir), adapter_paths)
    names = [f"a{i % len(adapter_paths)}" for i in range(PREFILL_SEQUENCES)]  # round-robin, as the engine's
    engine_base = EnginePrefill(str(model_dir), adapter_paths, num_tokens, 0)
    engine_lora = EnginePrefill(str(model_dir), adapter_paths, num_tokens, len(adapter_paths))
    runs = {"transformers forward (base)": lambda p: forward_run(model, p),
            "engine base": engine_base.run, "engine 8 adapters": engine_lora.run,
            "PEFT 8 adapters (mixed batch)": lambda p: forward_run(peft_model, p, adapter_names=names)}
    references = {"engine base": "transformers forward (base)",  # whose first tokens each engine's should equal
                  "engine 8 adapters": "PEFT 8 adapters (mixed batch)"}
    best, same = dict.fromkeys(runs, float("inf")), dict.fromkeys(references, 0)
    for repeat in range(args.repeats + 1):  # interleaved: a busy machine slows all four alike
        prompts = prefill_prompts(num_tokens, seed=100 + repeat)  # fresh: no prefix-cache hits
        results = {name: run(prompts) for name, run in runs.items()}
        for name, (seconds, _) in results.items():
            if repeat:  # the first run of each warms up
                best[name] = min(best[name], seconds)
        for name, reference in references.items():
            same[name] += sum(a == b for a, b in zip(results[name][1], results[reference][1]))
        logger.info("prefill run %d: %s", repeat, {name: round(s, 3) for name, s in best.items()})
    engine_base.engine.close()
    engine_lora.engine.close()
    tokens_per_s = {name: num_tokens / seconds for name, seconds in best.items()}
    base, forward, peft = (tokens_per_s[name] for name in ("engine base", "transformers forward (base)",
                                                           "PEFT 8 adapters (mixed batch)"))
    return [{"run": name, "sequences": PREFILL_SEQUENCES, "tokens": num_tokens, "prefill_tokens_per_s": value,
             "vs_engine_base": value / base, "vs_forward": value / forward, "vs_peft": value / peft,
             "same_first_token": (same[name] / (PREFILL_SEQUENCES * (args.repeats + 1)) if name in same else None)}
            for name, value in tokens_per_s.items()]


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--adapters", type=int, nargs="+", default=[0, 8, 32],
                   help="distinct adapters per row; the first must be 0 (the ratio's base)")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps per host row and path")
    p.add_argument("--paths", nargs="+", default=["auto"], choices=("auto", "padded", "segmented"),
                   help="torch LoRA strategies to time, alternating steps, for the tokens outside runs "
                        "(a slot's consecutive tokens, in place under every one; segmented = one matmul "
                        "group per adapter, as before issue 14)")
    p.add_argument("--profile", help="REQUESTS/ADAPTERS row to profile one step of, e.g. 64/8")
    p.add_argument("--batch", type=int, default=16, help="requests of the decode comparison")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="decode runs of each kind; the fastest counts")
    p.add_argument("--skip-host", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--prefill-tokens", type=int, default=2048,
                   help=f"tokens of the prefill table's one step, over {PREFILL_SEQUENCES} sequences")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out-dir", default="results")
    args = p.parse_args(argv)
    if args.adapters[0] != 0:
        p.error("--adapters must start with 0")
    if args.prefill_tokens < PREFILL_SEQUENCES:
        p.error(f"--prefill-tokens must be at least {PREFILL_SEQUENCES}")
    return args


def main(argv=None) -> dict:
    """Run the benchmark; returns the report (also written as JSON)."""
    args = parse_args(argv)
    started = start_cpu_run(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_step-") as tmp:
        host = [] if args.skip_host else host_table(Path(tmp), args)
        decode = [] if args.skip_decode else decode_table(Path(tmp), args)
        prefill = [] if args.skip_prefill else prefill_table(Path(tmp), args)
    report = {"clock": "process", "machine": machine_description("cpu"), "rank": RANK,
              "seconds": time.perf_counter() - started, "host": host, "decode": decode, "prefill": prefill}
    path = write_report(report, args.out_dir, "bench_step")
    for row in host:
        if "profile" in row:
            print(f"cProfile of {PROFILE_STEPS} decode steps, {row['num_requests']} requests / "
                  f"{row['num_adapters']} adapters (cumulative):\n{row['profile']}")
    if host:
        print(markdown_table(host, host_columns(args.paths)))
    if decode:
        print("\n" + markdown_table(decode, DECODE_COLUMNS))
        print(f"engine base tokens equal generate's for "
              f"{decode[1]['same_tokens_as_generate']:.0%} of requests")
    if prefill:
        print(f"\nprefill of {PREFILL_SEQUENCES} sequences in one step:\n"
              + markdown_table(prefill, PREFILL_COLUMNS))
    print(f"\nCPU seconds of this process, {args.threads} torch thread(s); written {path}")
    return report


if __name__ == "__main__":
    main()
