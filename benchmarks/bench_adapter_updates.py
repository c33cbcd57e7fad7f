"""Adapter updates as an RL loop makes them: update latency from tensors and from disk, and what a bystander pays.

On a random Llama (CPU, fp32), for each LoRA rank: the time from the update call to the first token served by the
new version, pushing tensors (`LLMEngine.update_lora`) and reloading a folder in place
(`add_lora(..., load_inplace=True)`), medians over --repeats updates (the first of each discarded: warm-up).
Then a bystander's base-model decode: its median and worst step time without updates, and with --updates rank-16
tensor pushes between its steps (the engine here is synchronous, so an update between two steps is counted in
the bystander's inter-token latency; an AsyncLLMEngine loads off the step thread). Wall-clock and this process's
CPU seconds are both reported: on a shared machine the CPU column is the steadier one.

    python benchmarks/bench_adapter_updates.py            # about a minute on 2 cores

Prints markdown tables (ratios against the run without updates) and writes
results/bench_adapter_updates-<time>.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

from adapters import LoRARequest
from lora_runner import LLMEngine, SamplingParams

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Clock:
    """Wall-clock and process CPU seconds of a block."""

    def __enter__(self) -> Clock:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def first_token(engine: LLMEngine, request: LoRARequest, request_id: str) -> None:
    engine.add_request(request_id, [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=1), lora_request=request)
    while not any(output.finished for output in engine.step()):
        pass


def update_latency(engine: LLMEngine, base, root: Path, rank: int, repeats: int) -> dict:
    """Median ms from the update call to the new version's first token, from tensors and from disk."""
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    peft = get_peft_model(copy.deepcopy(base), config)
    state, folder = get_peft_model_state_dict(peft), root / f"r{rank}"
    peft.save_pretrained(folder)
    runs = {"tensors": [], "disk": []}
    for i in range(repeats + 1):
        with Clock() as tensors:
            served = engine.update_lora(f"mem-{rank}", state, config)
            first_token(engine, served.request, f"mem-{rank}-{i}")
        with Clock() as disk:
            request = LoRARequest(f"disk-{rank}", str(folder))
            engine.add_lora(request, load_inplace=True)
            first_token(engine, request, f"disk-{rank}-{i}")
        runs["tensors"].append(tensors)
        runs["disk"].append(disk)
    row = {"rank": rank}
    for source, clocks in runs.items():
        row[f"{source}_wall_ms"] = statistics.median(c.wall for c in clocks[1:]) * 1e3
        row[f"{source}_cpu_ms"] = statistics.median(c.cpu for c in clocks[1:]) * 1e3
    return row


def bystander(engine: LLMEngine, base, updates: int, request_id: str) -> dict:
    """A base decode's step times, with ``updates`` rank-16 tensor pushes between its steps (0: none)."""
    config = LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    state = get_peft_model_state_dict(get_peft_model(copy.deepcopy(base), config))
    engine.add_request(request_id, [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2 * updates + 20,
                                                             ignore_eos=True))
    steps, pushed = [], 0
    while engine.has_unfinished_requests():
        with Clock() as step:
            if pushed < updates and len(steps) % 2 == 1:
                engine.update_lora("policy", state, config)
                pushed += 1
            engine.step()
        steps.append(step)
    steps = steps[2:]  # the prefill and the first decode
    return {"updates": pushed, "median_wall_ms": statistics.median(s.wall for s in steps) * 1e3,
            "max_wall_ms": max(s.wall for s in steps) * 1e3,
            "median_cpu_ms": statistics.median(s.cpu for s in steps) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--updates", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp())
    config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=256)
    base = LlamaForCausalLM(config).eval()
    base.save_pretrained(root / "model")
    engine = LLMEngine(str(root / "model"), device="cpu", max_num_seqs=8, max_model_len=256, max_loras=4,
                       max_lora_rank=max(args.ranks), max_cpu_loras=8, block_size=16, cpu_threads=1)
    latency = [update_latency(engine, base, root, rank, args.repeats) for rank in args.ranks]
    quiet, busy = bystander(engine, base, 0, "quiet"), bystander(engine, base, args.updates, "busy")
    engine.close()
    print(f"Update latency (call to the new version's first token), hidden {args.hidden}, {args.layers} layers, "
          f"median of {args.repeats}:\n")
    print("| rank | from tensors ms (wall / CPU) | from disk, load_inplace ms (wall / CPU) | disk / tensors (CPU) |")
    print("|---|---|---|---|")
    for row in latency:
        print(f"| {row['rank']} | {row['tensors_wall_ms']:.1f} / {row['tensors_cpu_ms']:.1f} | "
              f"{row['disk_wall_ms']:.1f} / {row['disk_cpu_ms']:.1f} | "
              f"{row['disk_cpu_ms'] / row['tensors_cpu_ms']:.2f} |")
    print("\nA bystander's base decode, step time:\n")
    print("| updates between its steps | median ms (wall / CPU) | worst ms (wall) | median CPU vs no updates |")
    print("|---|---|---|---|")
    for row in (quiet, busy):
        print(f"| {row['updates']} | {row['median_wall_ms']:.2f} / {row['median_cpu_ms']:.2f} | "
              f"{row['max_wall_ms']:.2f} | {row['median_cpu_ms'] / quiet['median_cpu_ms']:.2f} |")
    out = Path("results") / f"bench_adapter_updates-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "latency": latency, "bystander": [quiet, busy]}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
