"""The cost of EngineConfig.batch_invariant: the same requests served with and without the mode.

One random Llama-shaped model and a few random rank-16 LoRAs; a batch of requests with random
prompt and output lengths (greedy, EOS ignored), all added at once, served by LLMEngine to
completion, once per row: with adapters (each request a random adapter or the base) and without,
each in the default mode and in the batch-invariant one. tok/s counts generated tokens per
second of this process's CPU time (one torch thread), so other load on a shared machine does not
skew the ratio. The mode's cost is its fixed-shape GEMM row blocks (a decode row pays for
punica_kernels.invariant.ROW_BLOCK), its per-token attention and its per-slot LoRA.

With --device cuda (bf16, decode graphs on) the rows compare the mode's CUDA kernels with the default
ones: the fixed-config Triton GEMM against cuBLAS, the unsplit LoRA shrink, the prefill attention kernel
for every token against the split decode kernel, the row RMSNorm; tok/s counts wall-clock seconds.

    python benchmarks/bench_batch_invariant.py            # ~1-2 min on one CPU core
    python benchmarks/bench_batch_invariant.py --layers 8 --hidden 768 --requests 16
    python benchmarks/bench_batch_invariant.py --device cuda --layers 8 --hidden 4096 --requests 64

Prints a markdown table and writes results/bench_batch_invariant-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from common import ModelShape, machine_description, markdown_table, save_random_adapters, save_random_model

from adapters import LoRARequest
from lora_runner import LLMEngine, SamplingParams


def serve(model_dir: str, adapters: list[Path], requests: list[tuple], batch_invariant: bool,
          max_num_seqs: int, device: str = "cpu") -> dict:
    """Serve `requests` ((prompt, max_tokens, adapter index or None)) to completion; tok/s and steps
    (CPU: this process's CPU time; CUDA: wall-clock, the device synchronized)."""
    on_cpu = device == "cpu"
    engine = LLMEngine(model_dir, device=device, max_num_seqs=max_num_seqs, max_loras=max(1, len(adapters)),
                       max_lora_rank=16, max_num_batched_tokens=256, batch_invariant=batch_invariant,
                       **(dict(cpu_threads=1) if on_cpu else dict(dtype="bfloat16")))
    clock = time.process_time if on_cpu else time.perf_counter
    for i, (prompt, max_tokens, adapter) in enumerate(requests):
        lora = None if adapter is None else LoRARequest(f"a{adapter}", adapter + 1, str(adapters[adapter]))
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                           lora_request=lora)
    steps, generated = 0, 0
    start = clock()
    while engine.has_unfinished_requests():
        for output in engine.step():
            generated += len(output.outputs[0].token_ids) if output.finished else 0
        steps += 1
    if not on_cpu:
        torch.cuda.synchronize()
    seconds = clock() - start
    return {"tok_s": generated / seconds, "ms_per_step": 1000 * seconds / steps, "steps": steps,
            "tokens": generated}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--adapters", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = ModelShape(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_layers=args.layers,
                       num_heads=max(1, args.hidden // 64), num_kv_heads=max(1, args.hidden // 128), vocab_size=8000)
    gen = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_random_model(model_dir, shape)
        adapters = save_random_adapters(save_random_model(Path(tmp) / "copy", shape), Path(tmp) / "adapters",
                                        args.adapters, rank=16, progress=False)
        prompts = [([gen.randrange(4, shape.vocab_size) for _ in range(gen.randrange(16, 65))], gen.randrange(16, 33),
                    gen.choice([None, *range(args.adapters)])) for _ in range(args.requests)]
        rows = []
        for label, requests in (("adapters", prompts), ("base only", [(p, m, None) for p, m, _ in prompts])):
            for batch_invariant in (False, True):
                result = serve(str(model_dir), adapters, requests, batch_invariant, max_num_seqs=args.requests,
                               device=args.device)
                rows.append({"workload": label, "mode": "batch-invariant" if batch_invariant else "default",
                             **result})
            rows[-1]["ratio"] = rows[-1]["tok_s"] / rows[-2]["tok_s"]
            rows[-2]["ratio"] = 1.0
    print(markdown_table(rows, [("workload", "workload", "s"), ("mode", "mode", "s"), ("tok_s", "tok/s", ".1f"),
                                ("ms_per_step", "ms/step", ".1f"), ("ratio", "vs default", ".2f"),
                                ("steps", "steps", "d"), ("tokens", "tokens", "d")]))
    out = Path("results") / f"bench_batch_invariant-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "shape": vars(shape), "machine": machine_description(args.device),
                               "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
