"""Adapter load time: one rank-16 all-modules PEFT LoRA of a 1024-hidden 8-layer Llama-shaped model,
plain and DoRA.

  cold  adapter not in the CPU cache: resolve + read (safetensors) + validate (+ DoRA: the weight
        norms of every module, computed from the base weights on the device) + write into a slot,
        through AdapterManager.loras.add + activate. The file is in the OS page cache after the
        first repetition (we do not drop caches), so this is "cold" for the manager, not the disk.
  warm  adapter in the CPU cache but not resident: activate() evicts another adapter from the only
        slot and writes this one (reset the slot, copy every factor and scale).
Cold is also broken down into its stages (resolve, read, parse+validate (+ DoRA norms), slot
write), each timed directly on the same files.

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
from typing import NamedTuple

import torch

from adapters import AdapterManager, LoRARequest, ModelSpec
from adapters.hub import adapter_file_patterns, resolve
from adapters.lora import parse_lora
from adapters.slots import LoRASlots
from adapters.weights import read_adapter_config, read_adapter_tensors
from lora_runner.model.lora_linear import decoder_lora_modules

SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=4)  # head_dim 64, GQA 4:1
RANK, TARGETS = 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(root: Path, count: int, use_dora: bool = False, seed: int = 0):
    """(paths, base model): `count` random rank-16 all-module LoRAs (or DoRAs) written by PEFT for the
    benchmark's model shape, and the transformers base model they were trained on."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=256, **SHAPE)).eval()  # vocab is irrelevant to LoRA
    paths = []
    for i in range(count):
        peft_model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=32, target_modules=TARGETS,
                                                     init_lora_weights=False, use_dora=use_dora))
        paths.append(root / f"{'dora' if use_dora else 'lora'}{i}")
        peft_model.save_pretrained(str(paths[-1]))
        base = peft_model.unload()
    return paths, base


def packed_base_weights(base, spec: ModelSpec, device: torch.device, dtype: torch.dtype):
    """(layer, name) -> the base weight [N, K] as the engine's LoRA-aware linears hold it, on device."""
    packed = {module.key: torch.cat([base.get_submodule(path).weight for path, _ in module.peft_modules]).to(
        device=device, dtype=dtype) for module in spec.modules}
    return lambda layer, name: packed[layer, name]


class Sample(NamedTuple):
    """One timing: wall seconds, and this process' CPU seconds (all its threads), which is what the
    work costs when other processes share the cores."""

    wall: float
    cpu: float

    def __add__(self, other: "Sample") -> "Sample":
        return Sample(self.wall + other.wall, self.cpu + other.cpu)


def timed(fn, device: torch.device) -> Sample:
    """How long fn() takes, device work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, start_cpu = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return Sample(time.perf_counter() - start, time.process_time() - start_cpu)


def summary(samples: list[Sample]) -> dict:
    walls = [s.wall for s in samples]
    return dict(median_ms=1e3 * statistics.median(walls), min_ms=1e3 * min(walls),
                cpu_median_ms=1e3 * statistics.median(s.cpu for s in samples), reps=len(samples))


def manager_times(spec, target: Path, other: Path, base_weight, device, dtype, reps: int):
    """(cold, warm, device bytes): add + activate of `target`, and activate from the CPU cache."""
    manager = AdapterManager(spec, max_loras=1, max_lora_rank=RANK, max_cpu_loras=2, device=device, dtype=dtype,
                             base_weight=base_weight)
    ref_other = manager.loras.add(LoRARequest("other", str(other)))
    cold, warm = [], []
    for _ in range(reps + 1):  # the first repetition warms allocators and the page cache
        manager.loras.activate([ref_other])
        holder = {}
        cold.append(timed(lambda: holder.update(ref=manager.loras.add(LoRARequest("t", str(target)))), device)
                    + timed(lambda: manager.loras.activate([holder["ref"]]), device))
        manager.loras.activate([ref_other])
        warm.append(timed(lambda: manager.loras.activate([holder["ref"]]), device))
        manager.loras.remove("t")
    nbytes = manager.loras.memory_stats()["device_bytes_allocated"]
    manager.close()
    return cold[1:], warm[1:], nbytes


def stage_times(spec, target: Path, base_weight, device, dtype, reps: int):
    """({stage: seconds}, adapter bytes): the cold path's stages timed one by one."""
    stages = {"resolve": [], "read": [], "parse+validate": [], "slot write": []}
    slots = LoRASlots(spec, 1, RANK, device, dtype)
    for _ in range(reps + 1):
        out = {}
        stages["resolve"].append(timed(lambda: out.update(
            dir=resolve(str(target), allow_patterns=adapter_file_patterns())), device))
        stages["read"].append(timed(lambda: out.update(config=read_adapter_config("t", out["dir"]),
                                                       tensors=read_adapter_tensors("t", out["dir"])), device))
        stages["parse+validate"].append(timed(lambda: out.update(weights=parse_lora(
            "t", out["config"], out["tensors"], spec, max_lora_rank=RANK, dtype=dtype, base_weight=base_weight)),
            device))
        stages["slot write"].append(timed(lambda: slots.write(0, out["weights"]), device))
    return {name: samples[1:] for name, samples in stages.items()}, out["weights"].nbytes


def measure(kind: str, spec, root: Path, device, dtype, reps: int) -> tuple[dict, int, int]:
    """Rows of one adapter kind ("LoRA" or "DoRA"), its adapter bytes and the slots' device bytes."""
    (target, other), base = write_adapters(root, 2, use_dora=kind == "DoRA")
    base_weight = packed_base_weights(base, spec, device, dtype)
    cold, warm, nbytes = manager_times(spec, target, other, base_weight, device, dtype, reps)
    stages, adapter_bytes = stage_times(spec, target, base_weight, device, dtype, reps)
    norms = " (+ DoRA norms)" if kind == "DoRA" else ""
    rows = {f"{kind} cold (add + activate)": summary(cold), f"{kind} warm (activate from CPU cache)": summary(warm)}
    rows.update({f"  {kind} cold stage: {k}{norms if k == 'parse+validate' else ''}": summary(v)
                 for k, v in stages.items()})
    return rows, adapter_bytes, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    sizes = dict(num_layers=SHAPE["num_hidden_layers"], hidden_size=SHAPE["hidden_size"],
                 num_heads=SHAPE["num_attention_heads"], num_kv_heads=SHAPE["num_key_value_heads"],
                 head_dim=SHAPE["hidden_size"] // SHAPE["num_attention_heads"],
                 intermediate_size=SHAPE["intermediate_size"])
    spec = ModelSpec(**sizes, modules=decoder_lora_modules(argparse.Namespace(**sizes, fused_projections=False)))
    rows, sizes = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("LoRA", "DoRA"):
            kind_rows, sizes[kind], nbytes = measure(kind, spec, Path(tmp), device, dtype, args.reps)
            rows.update(kind_rows)
    print(f"rank-{RANK} all-modules LoRA and DoRA, Llama-shaped {SHAPE}, {dtype}, device {device}; adapter "
          f"{sizes['LoRA'] / 2**20:.1f} MiB (DoRA {sizes['DoRA'] / 2**20:.1f} MiB), "
          f"slot tensors {nbytes / 2**20:.1f} MiB")
    print(f"| {'what':48s} | median ms | min ms | CPU median ms |\n|{'-' * 50}|-----------|--------|---------------|")
    for what, row in rows.items():
        print(f"| {what:48s} | {row['median_ms']:9.2f} | {row['min_ms']:6.2f} | {row['cpu_median_ms']:13.2f} |")
    result = dict(shape=SHAPE, rank=RANK, dtype=str(dtype), device=str(device), adapter_bytes=sizes,
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
