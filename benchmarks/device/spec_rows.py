"""The device run's speculative-decoding rows: decode tokens/s and acceptance without speculation, with
n-gram drafts and with a draft model, each with the base model alone and with adapters (graphs on), and
the draft model with per-request draft adapters (``LoRARequest(..., draft_lora_path=...)``) at the most
adapters ("+ draft LoRAs").

One engine per method (speculative_config is fixed at start-up), each serving both adapter settings;
the draft is the run's random model truncated to its first layers (its embeddings, norm and head kept:
a smaller model that agrees with it sometimes, as benchmarks/bench_spec_decode.py's). The draft LoRAs'
row runs on the draft_model engine (no engine of its own: cheap): each dummy adapter gets a dummy draft
adapter of its name in the draft's tier, which is the adapter cut to the draft's layers (dummies are
seeded by name and drawn layer by layer), as bench_spec_decode.py builds its draft adapters. Its
``draft slot loads`` shows the draft adapters were written into the draft's slots, ``draft replays`` /
``draft eager`` whether the draft's forwards (with their LoRA) replayed graphs. The workload is
input-grounded: each prompt holds a passage and the start of it again, so n-gram proposals hit where
the model continues the passage. The adapters are the engine's dummy ones (every LoRA kernel runs).
A random model copies only by chance: the acceptance is a floor, the
rows show what verification costs and gains at that rate. Greedy, so every method's tokens should be
the run without speculation's (``same_as_no_spec``; half precision may flip a near-tie).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

import gpu_check

METHODS = ("none", "ngram", "draft_model")
DRAFT_LORAS = "draft_model + draft LoRAs"  # the row's name in results["spec_decode_skipped"]


def write_truncated_draft(model_dir: Path, out_dir: Path, num_layers: int) -> Path:
    """`model_dir`'s checkpoint (config.json + model.safetensors) cut to its first `num_layers` decoder layers."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    keep = {name: tensor for name, tensor in load_file(str(model_dir / "model.safetensors")).items()
            if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < num_layers}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(keep, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def grounded_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Prompts of about `length` tokens: a passage, then its first third again."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for _ in range(num):
        passage = torch.randint(4, vocab_size, (max(2, length * 3 // 4),), generator=gen).tolist()
        prompts.append(passage + passage[:len(passage) // 3])
    return prompts


def spec_config(method: str, k: int, draft_dir: Path) -> dict | None:
    if method == "none":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                "min_acceptance_rate": 0}
    return {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k, "min_acceptance_rate": 0}


def make_engine(model_dir: Path, sizes, spec: dict | None, k: int, num_requests: int, max_loras: int):
    """A graphed engine with `spec` serving `max_loras` dummy rank-16 adapters "bench-<i>" (CPU: graphs emulated)."""
    from lora_runner import LLMEngine
    from lora_runner.worker.cuda_graphs import RerunGraph

    engine = LLMEngine(str(model_dir), device=sizes.device, dtype=sizes.dtype, max_loras=max(1, max_loras),
                       max_lora_rank=16, max_cpu_loras=2 * max(1, max_loras), max_num_seqs=num_requests,
                       max_model_len=sizes.max_model_len, max_num_batched_tokens=2048, gpu_memory_utilization=0.8,
                       speculative_config=spec)
    if sizes.device == "cpu":
        engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False,
                                            num_speculative_tokens=k if spec else 0)
    for i in range(max_loras):
        engine.adapters.manager.loras.add_dummy(f"bench-{i}", 16)
    draft = draft_runner(engine)
    if draft is not None:
        if sizes.device == "cpu":  # the draft's graphs, with its LoRA (on CUDA the engine captured them)
            draft.capture_graphs(k, make_graph=RerunGraph)
        for i in range(max_loras):  # the target's dummy "bench-<i>" cut to the draft's layers (module docstring)
            engine.scheduler.speculator.proposer.adapters.tier.add_dummy(f"bench-{i}", 16)
    return engine


def draft_runner(engine):
    """The draft model's runner behind a "draft_model" engine's speculation policy (None: another method)."""
    speculator = engine.scheduler.speculator
    proposer = speculator.proposer if speculator is not None else None
    return getattr(proposer, "forward", None)


def serve(engine, prompts: list[list[int]], output_len: int, num_adapters: int, tag: str,
          draft_loras: bool = False) -> dict:
    """Serve the prompts (adapters round-robin, each with its draft adapter when ``draft_loras``) greedily to
    output_len tokens: decode tokens/s after every prompt's first token, the engine steps, the tokens."""
    from adapters import LoRARequest
    from lora_runner import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    draft_path = "<dummy>" if draft_loras else None  # the draft tier's dummy of the same name (make_engine)
    for i, prompt in enumerate(prompts):
        lora = LoRARequest(f"bench-{i % num_adapters}", "<dummy>", draft_lora_path=draft_path) if num_adapters else None
        engine.add_request(f"{tag}-{i}", prompt, params, lora_request=lora)
    progress, decode_start, decode_tokens, steps = {}, None, 0, 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        steps += 1
        for out in outputs:
            new = len(out.outputs[0].token_ids) - len(progress.get(out.request_id, ()))
            progress[out.request_id] = list(out.outputs[0].token_ids)
            decode_tokens += new if decode_start is not None else 0
        if decode_start is None and len(progress) == len(prompts):  # every prompt prefilled
            decode_start = time.perf_counter()
    seconds = max(time.perf_counter() - (decode_start or time.perf_counter()), 1e-9)
    return dict(tokens_per_s=decode_tokens / seconds, steps=steps,
                token_ids=[progress[f"{tag}-{i}"] for i in range(len(prompts))])


def spec_decode_rows(model_dir: Path, sizes, *, num_requests: int, prompt_len: int, output_len: int,
                     adapter_counts: tuple[int, ...], k: int, draft_layers: int, results: dict,
                     deadline: float) -> None:
    """results["spec_decode"]: one row per (method, adapters), and the draft LoRAs' row at the most adapters
    (see the module docstring); a method whose engine would start past `deadline`, or the draft LoRAs' row
    past it, is left out (results["spec_decode_skipped"] names it)."""
    rows = results["spec_decode"] = []
    draft_dir = write_truncated_draft(model_dir, model_dir.parent / "draft", draft_layers)
    prompts = grounded_prompts(num_requests, prompt_len, sizes.model["vocab_size"])
    baseline = {}
    for method in METHODS:
        if time.time() + gpu_check.ENGINE_SETUP_MARGIN_S * (sizes.device == "cuda") > deadline:
            results.setdefault("spec_decode_skipped", []).append(method)
            continue
        engine = make_engine(model_dir, sizes, spec_config(method, k, draft_dir), k, num_requests,
                             max(adapter_counts))
        try:
            serve(engine, prompts[:2], 2, 0, f"{method}-warmup")  # kernels compiled outside the timings
            for adapters in adapter_counts:
                row_start = time.time()
                rows.append(_measured(engine, method, adapters, k, baseline,
                                      lambda tag: serve(engine, prompts, output_len, adapters, tag)))
            if method == "draft_model" and max(adapter_counts):
                adapters, now = max(adapter_counts), time.time()
                if now + (now - row_start) > deadline:  # it costs about what the last row did (8 adapters too)
                    results.setdefault("spec_decode_skipped", []).append(DRAFT_LORAS)
                else:
                    rows.append(_measured(engine, method, adapters, k, baseline, lambda tag: serve(
                        engine, prompts, output_len, adapters, tag, draft_loras=True), draft_loras=True))
        finally:
            engine.close()
            del engine
            gpu_check.free_device_memory()


def _measured(engine, method: str, adapters: int, k: int, baseline: dict, serve_tagged,
              draft_loras: bool = False) -> dict:
    """The row of ``serve_tagged(tag)`` (serve with a tag) on `engine`, with the engine's counters read around
    it: its SpecDecodingStats, verify graph replays, and the draft's graph replays, eager forwards and slot
    loads."""
    graphs, draft = engine.runner.decode_graphs, draft_runner(engine)

    def counters() -> dict:
        if draft is None:
            return {}
        draft_graphs = draft.graphs.num_replays if draft.graphs is not None else 0
        loads = draft.adapters.tier.counts()["slot_loads"] if draft.adapters is not None else 0
        return dict(draft_replays=draft_graphs, draft_eager=draft.num_eager_forwards, draft_slot_loads=loads)

    verify_before = graphs.num_verify_replays if graphs is not None else 0
    before, draft_before = engine.stats.spec_decode, counters()
    run = serve_tagged(f"{method}-{adapters}{'-draft-loras' if draft_loras else ''}")
    row = _row(method, adapters, k, run, before, engine.stats.spec_decode, baseline,
               graphs.num_verify_replays - verify_before if graphs is not None else 0, draft_loras)
    row.update({name: value - draft_before[name] for name, value in counters().items()})
    return row


def _row(method: str, adapters: int, k: int, run: dict, before, after, baseline: dict, verify_replays: int,
         draft_loras: bool = False) -> dict:
    """One table row; `before` / `after`: the engine's SpecDecodingStats around the run (None: no speculation)."""
    name = method if method == "none" else f"{method} k={k}" + (" + draft LoRAs" if draft_loras else "")
    row = dict(method=name, adapters=adapters, tokens_per_s=run["tokens_per_s"], steps=run["steps"],
               verify_replays=verify_replays)
    if after is not None:
        drafts = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        verifies = after.num_drafts - before.num_drafts
        row.update(drafts=drafts, acceptance=accepted / max(drafts, 1),
                   mean_accepted_length=1 + accepted / max(verifies, 1))
    if method == "none":
        baseline[adapters] = run
    elif adapters in baseline:
        want = baseline[adapters]
        row["vs_no_spec"] = run["tokens_per_s"] / want["tokens_per_s"]
        same = sum(a == b for a, b in zip(run["token_ids"], want["token_ids"]))
        row["same_as_no_spec"] = same / len(want["token_ids"])
    return row


COLUMNS = [("method", "method", ""), ("adapters", "adapters", "d"), ("tokens_per_s", "decode tok/s", ".0f"),
           ("vs_no_spec", "x no spec", ".2f"), ("steps", "steps", "d"), ("drafts", "drafts", "d"),
           ("acceptance", "accept", ".2f"), ("mean_accepted_length", "mean len", ".2f"),
           ("verify_replays", "verify replays", "d"), ("draft_replays", "draft replays", "d"),
           ("draft_eager", "draft eager", "d"), ("draft_slot_loads", "draft slot loads", "d"),
           ("same_as_no_spec", "same tokens", ".0%")]
