"""The device run's checks that no other benchmark makes: split-K determinism, graphs against eager
on one engine, prefix-cache TTFT, FP8 and W4A16 decode through the engine against bf16.

Each takes the sizes it needs and a results dict it fills; run.py calls them in order with one random
model (gpu_check.write_random_model) and, where an engine is asked for, the one graphed engine.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

import gpu_check

MAX_LORAS = 32  # slots of the split-K check's layer (bench_kernels' layer)


def run_splitk(hidden: int, tokens: tuple[int, ...], repeats: int, device: torch.device, dtype: torch.dtype,
               results: dict) -> None:
    """add_lora (Triton: the shrink splits K at small T, its partials summed by the last split to arrive)
    run `repeats` times on the same inputs: every output must equal the first bit for bit."""
    from punica_kernels import LoRAMeta, add_lora, load_table
    from punica_kernels.triton_ops import choose_split_k, tile_programs

    rows = results["splitk"] = []
    gen = torch.Generator().manual_seed(0)
    rank = 16
    for num_tokens in tokens:
        rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=gen) * scale).to(device, dtype)  # noqa: E731
        x, y = rand(num_tokens, hidden), rand(num_tokens, hidden)  # [T, K], [T, N]
        lora_a = rand(MAX_LORAS, 1, rank, hidden, scale=hidden ** -0.5)  # [L, 1, r, K]
        lora_b = rand(MAX_LORAS, hidden, rank, scale=0.02)  # [L, N, r]
        meta = LoRAMeta(1024, MAX_LORAS, device, max_rank=rank, max_slices=1)
        load_table(meta, (torch.arange(num_tokens) % 8).to(device),
                   torch.full((MAX_LORAS,), rank, dtype=torch.int32, device=device))
        first = add_lora(y.clone(), x, lora_a, lora_b, meta, (hidden,), backend="triton")
        row_elements = num_tokens * rank
        split_k = choose_split_k(tile_programs(meta, num_tokens), hidden,
                                 meta.workspace_for(row_elements).numel() // row_elements)
        differing = sum(not torch.equal(add_lora(y.clone(), x, lora_a, lora_b, meta, (hidden,), backend="triton"),
                                        first) for _ in range(repeats))
        rows.append(dict(tokens=num_tokens, hidden=hidden, split_k=split_k, repeats=repeats, differing=differing))
    if any(row["differing"] for row in rows):
        raise AssertionError(f"split-K add_lora is not deterministic: {rows}")


def graphs_vs_eager(engine, sizes, points: list[tuple[int, int]], results: dict) -> None:
    """On the graphed engine: each (requests, adapters) decode twice with graphs and once eager (its
    decode graphs set aside): greedy tokens equal run to run and graphs to eager."""
    rows = results["graphs_vs_eager"] = []
    graphs = engine.runner.decode_graphs
    for num_requests, num_adapters in points:
        tag = f"ge{num_requests}-{num_adapters}"
        replays = graphs.num_replays
        first = gpu_check.decode_run(engine, sizes, num_requests, num_adapters, tag + "-g1")
        replayed = graphs.num_replays - replays
        again = gpu_check.decode_run(engine, sizes, num_requests, num_adapters, tag + "-g2")
        engine.runner.decode_graphs = None  # the runner's eager path, same weights and KV cache
        try:
            eager = gpu_check.decode_run(engine, sizes, num_requests, num_adapters, tag + "-e")
        finally:
            engine.runner.decode_graphs = graphs
        same = sum(a == b for a, b in zip(first["token_ids"], eager["token_ids"]))
        rows.append(dict(requests=num_requests, adapters=num_adapters, graph_replays=replayed,
                         repeat_identical=first["token_ids"] == again["token_ids"], same_as_eager=same / num_requests,
                         graphs_tok_s=first["tokens_per_s"], eager_tok_s=eager["tokens_per_s"]))
    bad = [row for row in rows if not row["repeat_identical"] or row["same_as_eager"] < 1 or not row["graph_replays"]]
    if bad:
        raise AssertionError(f"graphs vs eager: {bad}")


def prefix_cache_ttft(engine, vocab_size: int, prefix_len: int, repeats: int, results: dict) -> None:
    """TTFT of a prompt of prefix_len + 16 tokens whose prefix is new (cold) vs one whose prefix an
    earlier request left in the cache (warm); medians over `repeats` distinct prefixes."""
    from lora_runner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    cold, warm = [], []
    for repeat in range(repeats + 1):  # the first: warm-up (this prompt length's kernels)
        prefix = torch.randint(4, vocab_size, (prefix_len,), generator=gen).tolist()
        for kind, seconds in (("cold", cold), ("warm", warm)):
            prompt = prefix + torch.randint(4, vocab_size, (16,), generator=gen).tolist()
            start = time.perf_counter()
            engine.add_request(f"ttft-{repeat}-{kind}", prompt, params)
            while engine.has_unfinished_requests():
                engine.step()
            if repeat:
                seconds.append(time.perf_counter() - start)
    results["prefix_cache"] = dict(prefix_len=prefix_len, cold_ttft_ms=statistics.median(cold) * 1e3,
                                   warm_ttft_ms=statistics.median(warm) * 1e3,
                                   speedup=statistics.median(cold) / statistics.median(warm))


def write_gptq_copy(model_dir: Path, out_dir: Path, group_size: int, device: torch.device) -> Path:
    """`model_dir`'s checkpoint as a symmetric GPTQ (v1) one: every decoder-layer linear rounded to
    nearest int4 by groups of `group_size` input columns (lora_runner.model.quant.gptq's layout); the
    same model, 4-bit, not a second random one."""
    from safetensors.torch import load_file, save_file

    from lora_runner.model.quant.int4_layout import pack_int4

    tensors = {}
    for name, weight in load_file(str(model_dir / "model.safetensors")).items():
        if not (name.endswith("proj.weight") and ".layers." in name):
            tensors[name] = weight
            continue
        module, (n, k) = name.removesuffix(".weight"), weight.shape
        w = weight.to(device, torch.float32).view(n, k // group_size, group_size)  # [N, K/G, G]
        scales = (w.abs().amax(-1) / 7).clamp_min(1e-8)  # [N, K/G]
        q = (torch.round(w / scales[..., None]) + 8).clamp(0, 15).view(n, k)  # [N, K] 0..15
        tensors[f"{module}.qweight"] = pack_int4(q).t().contiguous().cpu()  # [K/8, N]
        tensors[f"{module}.qzeros"] = torch.full((k // group_size, n // 8), 0x77777777, dtype=torch.int32)  # 8 - 1
        tensors[f"{module}.scales"] = scales.t().contiguous().half().cpu()  # [K/G, N]
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
                                     "sym": True, "checkpoint_format": "gptq"}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def decode_rows(engine, weights: str, sizes, batches: tuple[int, ...], results: dict) -> None:
    """Decode tok/s of `engine` (no adapters) at each batch, as results["quant_decode"] rows of `weights`."""
    rows = results.setdefault("quant_decode", [])
    gpu_check.decode_run(engine, sizes, 2, 0, f"q-{weights}-warmup")
    for batch in batches:
        run = gpu_check.decode_run(engine, sizes, batch, 0, f"q-{weights}-{batch}")
        rows.append(dict(weights=weights, batch=batch, tokens_per_s=run["tokens_per_s"]))
    base = {row["batch"]: row["tokens_per_s"] for row in rows if row["weights"] == "bf16"}
    for row in rows:
        row["vs_bf16"] = row["tokens_per_s"] / base[row["batch"]] if row["batch"] in base else None


def quant_decode(model_dir: Path, sizes, batches: tuple[int, ...], group_size: int, results: dict,
                 deadline: float) -> None:
    """decode_rows (graphs on) of FP8 (quantization="fp8": per-channel FP8 weights made at load) and W4A16
    (a GPTQ copy of the model), one engine at a time; the bf16 rows come from the shared engine."""
    for weights in ("fp8", "w4a16"):
        if time.time() > deadline:
            raise TimeoutError(f"quant decode: no time left for {weights}")
        path = model_dir if weights == "fp8" else write_gptq_copy(model_dir, model_dir.parent / "w4a16", group_size,
                                                                   torch.device(sizes.device))
        engine = gpu_check.make_engine(path, sizes, graphs=True, max_loras=0, max_num_seqs=max(batches),
                                       quantization="fp8" if weights == "fp8" else None)
        try:
            decode_rows(engine, weights, sizes, batches, results)
        finally:
            engine.adapters.manager.close()
            del engine
            gpu_check.free_device_memory()
