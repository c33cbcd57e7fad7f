"""Adapter load time: one rank-16 all-modules PEFT LoRA of a 1024-hidden 8-layer Llama-shaped model.

  cold  adapter not in the CPU cache: resolve + read (safetensors) + validate + write into a slot,
        through AdapterManager.loras.add + activate. The file is in the OS page cache after the
        first repetition (we do not drop caches), so this is "cold" for the manager, not the disk.
  warm  adapter in the CPU cache but not resident: activate() evicts another adapter from the only
        slot and writes this one (zero the slot, copy every factor).
Cold is also broken down into its stages (resolve, read, parse+validate, slot write), each timed
directly on the same files.

    python benchmarks/bench_adapter_load.py                  # CPU, float32
    python benchmarks/bench_adapter_load.py --device cuda    # GPU, bfloat16 (pinned CPU cache)

Writes results/bench_adapter_load-<device>-<time>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from adapters import AdapterManager, LoRARequest, ModelSpec
from adapters.hub import adapter_file_patterns, resolve
from adapters.lora import parse_lora
from adapters.slots import LoRASlots
from adapters.weights import read_adapter_config, read_adapter_tensors

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4)  # head_dim 64, GQA 4:1
RANK, TARGETS = 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(root: Path, count: int) -> list[Path]:
    """`count` random rank-16 all-module LoRAs written by PEFT for the benchmark's model shape."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=256, **SHAPE)).eval()  # vocab is irrelevant to LoRA
    paths = []
    for i in range(count):
        peft_model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=32, target_modules=TARGETS,
                                                     init_lora_weights=False))
        paths.append(root / f"adapter{i}")
        peft_model.save_pretrained(str(paths[-1]))
        base = peft_model.unload()
    return paths


def timed(fn, device: torch.device) -> float:
    """Seconds fn() takes, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def summary(samples: list[float]) -> dict:
    return dict(median_ms=1e3 * statistics.median(samples), min_ms=1e3 * min(samples), reps=len(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    spec = ModelSpec(num_layers=SHAPE["num_hidden_layers"], hidden_size=SHAPE["hidden_size"],
                     num_heads=SHAPE["num_attention_heads"], num_kv_heads=SHAPE["num_key_value_heads"],
                     head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
                     intermediate_size=SHAPE["intermediate_size"])
    with tempfile.TemporaryDirectory() as tmp:
        target, other = write_adapters(Path(tmp), 2)
        manager = AdapterManager(spec, max_loras=1, max_lora_rank=RANK, max_cpu_loras=2, device=device, dtype=dtype)
        ref_other = manager.loras.add(LoRARequest("other", str(other)))
        cold, warm = [], []
        for _ in range(args.reps + 1):  # the first repetition warms allocators and the page cache
            manager.loras.activate([ref_other])
            holder = {}
            cold.append(timed(lambda: holder.update(ref=manager.loras.add(LoRARequest("t", str(target)))), device)
                        + timed(lambda: manager.loras.activate([holder["ref"]]), device))
            manager.loras.activate([ref_other])
            warm.append(timed(lambda: manager.loras.activate([holder["ref"]]), device))
            manager.loras.remove("t")
        nbytes = manager.loras.memory_stats()["device_bytes_allocated"]
        manager.close()

        stages = {"resolve": [], "read": [], "parse+validate": [], "slot write": []}
        slots = LoRASlots(spec, 1, RANK, device, dtype)
        for _ in range(args.reps + 1):
            out = {}
            stages["resolve"].append(timed(lambda: out.update(
                dir=resolve(str(target), allow_patterns=adapter_file_patterns())), device))
            stages["read"].append(timed(lambda: out.update(config=read_adapter_config("t", out["dir"]),
                                                           tensors=read_adapter_tensors("t", out["dir"])), device))
            stages["parse+validate"].append(timed(lambda: out.update(weights=parse_lora(
                "t", out["config"], out["tensors"], spec, max_lora_rank=RANK, dtype=dtype)), device))
            stages["slot write"].append(timed(lambda: slots.write(0, out["weights"]), device))
        adapter_bytes = out["weights"].nbytes
    rows = {"cold (add + activate)": summary(cold[1:]), "warm (activate from CPU cache)": summary(warm[1:])}
    rows.update({f"  cold stage: {k}": summary(v[1:]) for k, v in stages.items()})
    print(f"rank-{RANK} all-modules LoRA, Llama-shaped {SHAPE}, {dtype}, device {device}; "
          f"adapter {adapter_bytes / 2**20:.1f} MiB, slot tensors {nbytes / 2**20:.1f} MiB")
    print(f"| {'what':36s} | median ms | min ms |\n|{'-' * 38}|-----------|--------|")
    for what, row in rows.items():
        print(f"| {what:36s} | {row['median_ms']:9.2f} | {row['min_ms']:6.2f} |")
    result = dict(shape=SHAPE, rank=RANK, dtype=str(dtype), device=str(device), adapter_bytes=adapter_bytes,
                  machine=dict(platform=platform.platform(), torch=torch.__version__,
                               cpu_threads=torch.get_num_threads(),
                               gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None),
                  results=rows)
    out_dir = Path("results")
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"bench_adapter_load-{device.type}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
