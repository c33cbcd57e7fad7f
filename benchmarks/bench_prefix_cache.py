"""Prefix-caching benchmark: a multi-tenant chat workload with caching on vs off, in the same run.

Workload: --tenants tenants, each with its own LoRA and its own system prompt of --system-len tokens,
--chats conversations per tenant of --turns turns. A turn's prompt is the system prompt, the earlier
turns (user messages and replies) and a new user message of --user-len tokens; a conversation's next
turn is sent when its previous reply finished (closed loop), each tenant's requests salted with the
tenant (as the server does). Three scenarios, each with caching on and off on the same engine settings:

  chat         the workload alone
  chat+flood   the same while one more tenant floods distinct long prompts (one per chat turn sent)
  no-sharing   every prompt distinct (no shared prefix): what caching costs when it cannot help

Per run: prefill tokens computed (prompt tokens minus those served from the cache), TTFT p50/p99 of
turns after the first (wall clock from add_request to the first token), output tokens per CPU second
of this process, the hit rate (cache-hit tokens / looked-up tokens), and the prefix-cache bookkeeping
(hashing, lookups, registration: BlockManager.cached_prefix + cache_computed) per engine step.

    python benchmarks/bench_prefix_cache.py --quick   # CPU, small random model, a few minutes

Writes results/bench_prefix_cache-<time>.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path

import torch

from common import ModelShape, machine_description, markdown_table, percentile, save_random_adapters, \
    save_random_model  # benchmarks/common.py

from adapters import LoRARequest
from lora_runner import LLMEngine, SamplingParams
from lora_runner.core.block_manager import BlockManager

logger = logging.getLogger("bench_prefix_cache")

QUICK_SHAPE = ModelShape(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
                         vocab_size=4096, max_position_embeddings=4096)
FULL_SHAPE = ModelShape(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4)


class BookkeepingClock:
    """Seconds spent in the block manager's prefix-cache calls (wraps them for one run)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._originals = {name: getattr(BlockManager, name) for name in ("cached_prefix", "cache_computed")}

    def __enter__(self) -> BookkeepingClock:
        for name, original in self._originals.items():
            setattr(BlockManager, name, self._timed(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(BlockManager, name, original)

    def _timed(self, original):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(4, vocab) for _ in range(n)]


def run(engine: LLMEngine, args, loras: list[LoRARequest], scenario: str, vocab: int) -> dict:
    """Drive the chats (and the flood) to completion; returns the run's numbers."""
    rng = random.Random(0)
    systems = [tokens(rng, args.system_len, vocab) for _ in loras]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    chats = {(t, c): [] for t in range(len(loras)) for c in range(args.chats)}  # history after the system prompt
    turn_of = dict.fromkeys(chats, 0)
    live: dict[str, tuple] = {}  # request id -> (chat or None for the flood, turn, added at)
    first_token_at: dict[str, float] = {}
    ttft_later, prompt_tokens, cached_tokens, output_tokens, steps = [], 0, 0, 0, 0

    def send(chat) -> None:
        nonlocal prompt_tokens
        tenant, _ = chat
        if scenario == "no-sharing":  # a fresh prompt as long as the shared one would be
            prompt = tokens(rng, args.system_len + len(chats[chat]) + args.user_len, vocab)
        else:
            chats[chat] += tokens(rng, args.user_len, vocab)
            prompt = systems[tenant] + chats[chat]
        request_id = f"{tenant}-{chat[1]}-t{turn_of[chat]}"
        live[request_id] = (chat, turn_of[chat], time.perf_counter())
        engine.add_request(request_id, prompt, params, lora_request=loras[tenant], cache_salt=f"tenant-{tenant}")
        prompt_tokens += len(prompt)
        if scenario == "chat+flood":
            flood_id = f"flood-{request_id}"
            live[flood_id] = (None, 0, time.perf_counter())
            engine.add_request(flood_id, tokens(rng, args.system_len, vocab), params, cache_salt="flood")

    cpu_start = time.process_time()
    with BookkeepingClock() as clock:
        for chat in chats:
            send(chat)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            steps += 1
            now = time.perf_counter()
            for output in outputs:
                chat, turn, added = live[output.request_id]
                if output.outputs[0].token_ids and output.request_id not in first_token_at:
                    first_token_at[output.request_id] = now
                    if chat is not None and turn > 0:
                        ttft_later.append(now - added)
                if not output.finished:
                    continue
                output_tokens += len(output.outputs[0].token_ids)
                if chat is None:
                    continue
                cached_tokens += output.num_cached_tokens
                chats[chat] += output.outputs[0].token_ids
                turn_of[chat] += 1
                if turn_of[chat] < args.turns:
                    send(chat)
    cpu_s = time.process_time() - cpu_start
    stats = engine.stats
    return {"scenario": scenario, "caching": engine.config.enable_prefix_caching,
            "prefill_computed": prompt_tokens - cached_tokens, "prompt_tokens": prompt_tokens,
            "ttft_p50_ms": 1e3 * percentile(ttft_later, 50), "ttft_p99_ms": 1e3 * percentile(ttft_later, 99),
            "tok_per_cpu_s": output_tokens / cpu_s, "cpu_s": cpu_s, "steps": steps,
            "hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0,
            "bookkeeping_us_per_step": 1e6 * clock.seconds / max(steps, 1)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU, a small random model")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--chats", type=int, default=2, help="conversations per tenant")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=500)
    p.add_argument("--user-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--scenarios", default="chat,chat+flood,no-sharing")
    p.add_argument("--reverse", action="store_true", help="run caching on first (to see order effects)")
    p.add_argument("--out", type=Path, default=Path("results"))
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)  # steady numbers on a shared machine; CPU seconds are this process's
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = save_random_model(Path(tmp) / "model", shape, initializer_range=0.05)
        paths = save_random_adapters(model, Path(tmp), args.tenants, rank=8, progress=False)
        loras = [LoRARequest(f"tenant-{i}", str(path)) for i, path in enumerate(paths)]
        max_len = args.system_len + args.turns * (args.user_len + args.output_len) + 16
        for scenario in args.scenarios.split(","):
            for caching in ((True, False) if args.reverse else (False, True)):
                engine = LLMEngine(str(Path(tmp) / "model"), device="cpu", max_loras=args.tenants,
                                   max_lora_rank=8, max_num_seqs=2 * args.tenants * args.chats,
                                   max_model_len=max_len, max_num_batched_tokens=2048, block_size=16,
                                   enable_prefix_caching=caching, cpu_threads=1)
                for lora in loras:
                    engine.add_lora(lora)
                rows.append(run(engine, args, loras, scenario, shape.vocab_size))
                engine.close()
                logger.warning("%s", rows[-1])
    columns = [("scenario", "scenario", "s"), ("caching", "caching", ""), ("prefill_computed", "prefill tokens", "d"),
               ("ttft_p50_ms", "TTFT p50 turns 2+ (ms)", ".1f"), ("ttft_p99_ms", "TTFT p99 (ms)", ".1f"),
               ("tok_per_cpu_s", "tok / CPU s", ".1f"), ("hit_rate", "hit rate", ".2f"),
               ("bookkeeping_us_per_step", "cache µs / step", ".1f")]
    print(markdown_table(rows, columns))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"bench_prefix_cache-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"machine": machine_description("cpu"), "args": vars(args), "rows": rows},
                               indent=2, default=str))
    print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()
