"""A long prompt beside decoding streams on CPU: what the decodes wait per step (issue 23 item 11).

Two measurements, one torch thread, this process's CPU time (immune to other processes on a shared
machine), each with the torch attention path as it is ("grouped": length groups, see
lora_runner/model/attention.py) and as it was ("padded": every sequence of a step padded to the
step's longest query and context, one call):

  layer    one layer's paged_attention on synthetic steps: a prefill chunk of --chunk tokens ending
           at --prompt-len beside 8 decodes, the whole prompt in one chunk beside 8 decodes, 8 decodes
           beside one long-context decode, and 16 decodes of similar lengths (one call either way: the
           host overhead check). Median ms per call and the scores computed vs the sequences' own.
  engine   a random Llama (--layers, hidden 256) served by LLMEngine: 8 streams decode, then one
           --prompt-len-token prompt arrives and is prefilled in chunks of max_num_batched_tokens
           (--chunk); the CPU seconds of each step that carries a chunk (every stream's token
           waits on it) and of the decode-only steps around them.

    python benchmarks/bench_mixed_step.py                      # both, a few minutes on one core
    python benchmarks/bench_mixed_step.py --skip-engine        # layer table only
    python benchmarks/bench_mixed_step.py --chunk 6016         # the whole prompt in one step

Writes results/bench_mixed_step-<time>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import (ModelShape, machine_description, markdown_table,  # benchmarks/common.py
                    save_random_model, start_cpu_run, write_report)

logger = logging.getLogger("bench_mixed_step")

MODES = ("padded", "grouped")
NUM_STREAMS = 8
STREAM_PROMPT_LEN = 32
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 4, 32, 16

LAYER_COLUMNS = [("case", "step", ""), ("mode", "attention", ""), ("ms_per_call", "ms/call", ".1f"),
                 ("score_ratio", "scores / own", ".2f"), ("calls", "calls", "d"),
                 ("speedup", "vs padded", ".1f")]
ENGINE_COLUMNS = [("mode", "attention", ""), ("chunk", "chunk", "d"), ("mixed_steps", "steps with a chunk", "d"),
                  ("mixed_step_s_max", "max s/step (chunk + 8 decodes)", ".2f"),
                  ("mixed_step_s_sum", "s until the prompt's first token", ".2f"),
                  ("decode_step_ms", "decode-only ms/step", ".1f"), ("speedup", "vs padded", ".1f")]


@contextlib.contextmanager
def attention_mode(mode: str):
    """The torch attention path as it is ("grouped") or with one padded call per step ("padded")."""
    from lora_runner.model import attention

    original = attention._host_length_groups  # noqa: SLF001 - the switch between the two behaviours
    if mode == "padded":
        attention._host_length_groups = lambda attn: None  # noqa: SLF001
    try:
        yield
    finally:
        attention._host_length_groups = original  # noqa: SLF001


class ScoreCounter:
    """Counts the score elements of scaled_dot_product_attention calls while active."""

    def __init__(self) -> None:
        self.elements = self.calls = 0
        self._sdpa = torch.nn.functional.scaled_dot_product_attention

    def __enter__(self):
        def counted(q, k, v, *args, **kwargs):
            self.elements += q.shape[:-1].numel() * k.shape[-2]
            self.calls += 1
            return self._sdpa(q, k, v, *args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = counted
        return self

    def __exit__(self, *exc) -> None:
        torch.nn.functional.scaled_dot_product_attention = self._sdpa


def synthetic_step(query_lens: list[int], seq_lens: list[int], gen: torch.Generator):
    """(query [T, H, D], kv_layer, AttentionMetadata) of one step, random K/V in shuffled blocks."""
    from lora_runner.model.forward_context import AttentionMetadata

    blocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    order = torch.randperm(sum(blocks), generator=gen)
    kv_layer = torch.randn(2, sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    for seq, first in enumerate(np.cumsum([0] + blocks[:-1])):
        tables[seq, :blocks[seq]] = order[first:first + blocks[seq]]
    starts = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    attn = AttentionMetadata(slot_mapping=torch.full((sum(query_lens),), -1), query_start_loc=starts,
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
                             max_query_len=max(query_lens), max_seq_len=max(seq_lens))
    return torch.randn(sum(query_lens), HEADS, HEAD_DIM, generator=gen), kv_layer, attn


def layer_cases(prompt_len: int, chunk: int) -> dict[str, tuple[list[int], list[int]]]:
    """name -> (query lens, seq lens) of the synthetic steps."""
    decodes = list(range(40, 40 + 8 * 12, 12))  # 8 streams' contexts
    return {f"chunk {chunk} @ {prompt_len} + 8 decodes": ([chunk] + [1] * 8, [prompt_len] + decodes),
            f"prefill {prompt_len} + 8 decodes": ([prompt_len] + [1] * 8, [prompt_len] + decodes),
            f"decode @ {prompt_len} + 8 decodes": ([1] * 9, [prompt_len] + decodes),
            "16 decodes @ 40..55": ([1] * 16, list(range(40, 56)))}


def layer_table(args) -> list[dict]:
    """Median CPU ms per paged_attention call of each synthetic step, both modes."""
    from lora_runner.model.attention import paged_attention

    rows = []
    for case, (query_lens, seq_lens) in layer_cases(args.prompt_len, args.chunk).items():
        query, kv_layer, attn = synthetic_step(query_lens, seq_lens, torch.Generator().manual_seed(0))
        own = HEADS * sum(q * s for q, s in zip(query_lens, seq_lens))
        outputs = {}
        for mode in MODES:
            with attention_mode(mode):
                with ScoreCounter() as counter:
                    outputs[mode] = paged_attention(query, kv_layer, attn, HEAD_DIM ** -0.5, backend="torch")
                times = []
                for _ in range(args.repeats):
                    start = time.process_time()
                    paged_attention(query, kv_layer, attn, HEAD_DIM ** -0.5, backend="torch")
                    times.append(time.process_time() - start)
            rows.append({"case": case, "mode": mode, "ms_per_call": 1e3 * statistics.median(times),
                         "score_ratio": counter.elements / own, "calls": counter.calls})
        rows[-1]["speedup"] = rows[-2]["ms_per_call"] / rows[-1]["ms_per_call"]
        rows[-1]["max_abs_diff"] = float((outputs["padded"] - outputs["grouped"]).abs().max())
        logger.info("%s: padded %.1f ms, grouped %.1f ms", case, rows[-2]["ms_per_call"], rows[-1]["ms_per_call"])
    return rows


def engine_run(model_dir: str, args, mode: str) -> dict:
    """Step times of 8 decoding streams while one long prompt is prefilled beside them."""
    from lora_runner import LLMEngine, SamplingParams

    engine = LLMEngine(model_dir, device="cpu", max_num_seqs=NUM_STREAMS + 1, max_model_len=args.prompt_len + 64,
                       max_num_batched_tokens=args.chunk, block_size=BLOCK_SIZE, enforce_eager=True)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_steps + 64, ignore_eos=True)
    for i in range(NUM_STREAMS):
        engine.add_request(f"stream-{i}", rng.integers(4, 1024, STREAM_PROMPT_LEN).tolist(), params)
    with attention_mode(mode):
        engine.step()  # the streams' prefill
        decode_times = [_timed_step(engine)[0] for _ in range(args.decode_steps)]
        engine.add_request("long", rng.integers(4, 1024, args.prompt_len).tolist(),
                           SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        mixed_times, streams_served = [], []
        while True:
            seconds, outputs = _timed_step(engine)
            mixed_times.append(seconds)
            streams_served.append(sum(o.request_id.startswith("stream") for o in outputs))
            if any(o.request_id == "long" and o.finished for o in outputs):
                break
    return {"mode": mode, "chunk": args.chunk, "mixed_steps": len(mixed_times),
            "mixed_step_s": mixed_times, "mixed_step_s_max": max(mixed_times), "mixed_step_s_sum": sum(mixed_times),
            "stream_tokens_per_mixed_step": streams_served,
            "decode_step_ms": 1e3 * statistics.median(decode_times)}


def _timed_step(engine) -> tuple[float, list]:
    start = time.process_time()
    outputs = engine.step()
    return time.process_time() - start, outputs


def engine_table(tmp: Path, args) -> list[dict]:
    """engine_run for both modes on one random model."""
    shape = ModelShape(hidden_size=HEADS * HEAD_DIM, intermediate_size=512, num_layers=args.layers,
                       num_heads=HEADS, num_kv_heads=KV_HEADS, vocab_size=1024,
                       max_position_embeddings=2 ** math.ceil(math.log2(args.prompt_len + 64)))
    save_random_model(tmp / "model", shape)
    rows = [engine_run(str(tmp / "model"), args, mode) for mode in MODES]
    rows[1]["speedup"] = rows[0]["mixed_step_s_max"] / rows[1]["mixed_step_s_max"]
    return rows


def parse_args(argv=None):
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=6000)
    p.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens (the CPU default is 2048)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per layer row; the median counts")
    p.add_argument("--decode-steps", type=int, default=5, help="decode-only steps timed before the prompt")
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out-dir", default="results")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Run the benchmark; returns the report (also written as JSON)."""
    args = parse_args(argv)
    started = start_cpu_run(args.threads)
    layer = [] if args.skip_layer else layer_table(args)
    with tempfile.TemporaryDirectory(prefix="bench_mixed_step-") as tmp:
        engine = [] if args.skip_engine else engine_table(Path(tmp), args)
    report = {"clock": "process", "machine": machine_description("cpu"), "args": vars(args),
              "seconds": time.perf_counter() - started, "layer": layer, "engine": engine}
    path = write_report(report, args.out_dir, "bench_mixed_step")
    if layer:
        print(markdown_table(layer, LAYER_COLUMNS))
    if engine:
        print("\n" + markdown_table(engine, ENGINE_COLUMNS))
    print(f"\nCPU seconds of this process, {args.threads} torch thread(s); written {path}")
    return report


if __name__ == "__main__":
    main()
