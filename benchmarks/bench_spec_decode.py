"""Speculative decoding (n-gram and draft model) benchmark: the same requests with and without speculation.

Workloads (greedy, so both runs produce the same tokens and only the cost differs):

  grounded    each prompt holds a passage twice, the second copy cut short (an edit / summary of a
              given text: what follows is in the prompt, where n-gram proposals hit when the model
              continues the passage)
  open        random prompts without repetition (n-gram drafts hit only where the output repeats)

each with the base model alone and with --adapters LoRAs (requests spread over them), each without
speculation, with {"method": "ngram", "num_speculative_tokens": k} and with {"method": "draft_model",
"model": DRAFT, "num_speculative_tokens": k} for each --k. The draft is the model's first
--draft-layers layers with its embeddings and head (a smaller model that agrees with it sometimes;
with all its layers, the model itself: the acceptance ceiling). With LoRAs, each draft runs twice: without
adapters (it proposes the base model's tokens) and with per-request draft adapters ("+ draft LoRAs":
``LoRARequest(..., draft_lora_path=...)``, each request's draft adapter is its own adapter cut to the draft's
layers, so a draft of all the layers with them proposes exactly what its request decodes).
Per run: output tokens, engine steps, CPU seconds of this process (the draft's forwards included),
output tokens per CPU second and per step, acceptance rate (accepted / proposed draft tokens) and
mean accepted length (1 + accepted drafts per verify step). A random model copies its prompt only by
chance, so n-gram acceptance here is a floor: the table shows what verification costs and gains at
that rate, not what a trained model gets.

    python benchmarks/bench_spec_decode.py --quick   # CPU, small random model (~30 min on 2 busy cores)
    python benchmarks/bench_spec_decode.py --quick --methods draft_model --draft-layers 1 4 --k 3
    python benchmarks/bench_spec_decode.py --quick --methods draft_model --draft-layers 2 4 --workloads open \
        --requests 8 --output-len 32 --repeats 1   # the per-request draft adapter rows, shorter

Writes results/bench_spec_decode-<time>.json and prints the table with ratios against the run
without speculation.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path

from common import ModelShape, machine_description, markdown_table, save_random_adapters, \
    save_random_model  # benchmarks/common.py

from adapters import LoRARequest
from lora_runner import LLMEngine, SamplingParams

logger = logging.getLogger("bench_spec_decode")

QUICK_SHAPE = ModelShape(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=8, num_kv_heads=4,
                         vocab_size=256, max_position_embeddings=4096)  # small vocab: greedy loops, drafts hit
FULL_SHAPE = ModelShape(hidden_size=768, intermediate_size=2048, num_layers=8, num_heads=12, num_kv_heads=4)


def prompts(workload: str, num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """The workload's prompts of about `length` tokens (see the module docstring)."""
    rng = random.Random(seed)
    result = []
    for _ in range(num):
        if workload == "grounded":
            passage = [rng.randrange(4, vocab) for _ in range(length // 2)]
            result.append(passage + passage[:len(passage) // 3])
        else:
            result.append([rng.randrange(4, vocab) for _ in range(length)])
    return result


def save_truncated_draft(base, path: Path, num_layers: int) -> None:
    """The draft: `base`'s first `num_layers` decoder layers, its embeddings, norm and head, with its tokenizer."""
    import shutil

    from transformers import LlamaForCausalLM

    config = base.config.__class__.from_dict({**base.config.to_dict(), "num_hidden_layers": num_layers})
    draft = LlamaForCausalLM(config).eval()
    missing, _ = draft.load_state_dict(base.state_dict(), strict=False)  # the layers past num_layers are left out
    assert not missing, f"the draft's {missing[:3]} ... are not the base model's (save it before adapters wrap it)"
    draft.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(base.name_or_path) / name).is_file():
            shutil.copy(Path(base.name_or_path) / name, path / name)


def save_draft_adapters(adapters: list[LoRARequest], root: Path, num_layers: int) -> list[LoRARequest]:
    """Each adapter with a draft adapter: its own weights of decoder layers 0..num_layers-1 (the draft's
    layers, save_truncated_draft) written beside it; the requests name them as draft_lora_path."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    with_drafts = []
    for lora in adapters:
        path = root / f"{Path(lora.path).name}-draft-{num_layers}"
        path.mkdir(exist_ok=True)
        shutil.copy(Path(lora.path) / "adapter_config.json", path / "adapter_config.json")
        tensors = load_file(str(Path(lora.path) / "adapter_model.safetensors"))
        kept = {key: t for key, t in tensors.items()
                if (m := re.search(r"\.layers\.(\d+)\.", key)) is None or int(m.group(1)) < num_layers}
        save_file(kept, str(path / "adapter_model.safetensors"))
        with_drafts.append(LoRARequest(lora.name, lora.path, draft_lora_path=str(path)))
    return with_drafts


def spec_config(method: str, k: int, draft_dir: str) -> dict | None:
    """The speculative_config of a row (None: no speculation)."""
    if k == 0:
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    return {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": k}


def run(model_dir: str, spec: dict | None, requests: list[list[int]], loras: list[LoRARequest], args) -> dict:
    """Serve every request to completion on a fresh engine (adapters loaded before the clock starts);
    returns the run's numbers, CPU and wall seconds the least of --repeats runs."""
    best = None
    for _ in range(args.repeats):
        engine = LLMEngine(model_dir, device="cpu", max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                           max_loras=max(1, len(loras)), max_lora_rank=args.rank, speculative_config=spec)
        for lora in loras:
            engine.add_lora(lora)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        for i, prompt in enumerate(requests):
            engine.add_request(f"r{i}", prompt, params, lora_request=loras[i % len(loras)] if loras else None)
        steps, output_tokens = 0, {}
        cpu, wall = time.process_time(), time.perf_counter()
        while engine.has_unfinished_requests():
            engine.wait_for_work(timeout=1.0)  # while the first activation's loads finish
            outputs = engine.step()
            for out in outputs:
                output_tokens[out.request_id] = len(out.outputs[0].token_ids)
            steps += bool(outputs)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        stats = engine.stats.spec_decode
        engine.close()
        if best is None or cpu < best[0]:
            best = cpu, wall, steps, sum(output_tokens.values()), stats
    cpu, wall, steps, tokens, stats = best
    row = {"output_tokens": tokens, "steps": steps, "cpu_s": cpu, "wall_s": wall,
           "tokens_per_cpu_s": tokens / cpu, "tokens_per_step": tokens / steps}
    if stats is not None:
        row.update(proposed=stats.num_draft_tokens, accepted=stats.num_accepted_tokens,
                   acceptance=stats.num_accepted_tokens / max(stats.num_draft_tokens, 1),
                   mean_accepted_length=1 + stats.num_accepted_tokens / max(stats.num_drafts, 1))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model (default: a 768-hidden 8-layer one)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--k", type=int, nargs="+", default=[3])
    parser.add_argument("--methods", nargs="+", default=["ngram", "draft_model"], choices=["ngram", "draft_model"])
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[1],
                        help="decoder layers of the draft model, one row per value (the model's own count: draft = "
                             "target, the acceptance ceiling)")
    parser.add_argument("--workloads", nargs="+", default=["grounded", "open"], choices=["grounded", "open"])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="runs per row; the least CPU time is kept")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        # a large initializer range gives peaky logits: greedy decoding follows patterns, as a trained model's
        base = save_random_model(root / "model", shape, seed=args.seed, initializer_range=0.2)
        base.name_or_path = str(root / "model")
        for layers in args.draft_layers:  # before the adapters: PEFT wraps the base model's modules in place
            save_truncated_draft(base, root / f"draft-{layers}", layers)
        adapters = [LoRARequest(p.name, str(p)) for p in save_random_adapters(base, root, args.adapters, args.rank)]
        draft_adapters = {layers: save_draft_adapters(adapters, root, layers) for layers in args.draft_layers}
        run(str(root / "model"), None, prompts("open", 2, 16, shape.vocab_size, args.seed), [], args)  # warm-up
        for workload in args.workloads:
            requests = prompts(workload, args.requests, args.prompt_len, shape.vocab_size, args.seed)
            for loras in ([], adapters):
                baseline = None
                variants = [("ngram", None, False)] * ("ngram" in args.methods) + [
                    ("draft_model", layers, draft_loras) for layers in args.draft_layers
                    for draft_loras in ([False, True] if loras else [False]) if "draft_model" in args.methods]
                for method, layers, draft_loras, k in [("none", None, False, 0)] + [
                        (m, n, d, k) for m, n, d in variants for k in args.k]:
                    spec = spec_config(method, k, str(root / f"draft-{layers}"))
                    name = method if layers is None else f"draft {layers}/{shape.num_layers} layers"
                    name += " + draft LoRAs" if draft_loras else ""
                    requested = draft_adapters[layers] if draft_loras else loras
                    row = {"workload": workload, "adapters": len(loras), "method": name, "k": k,
                           **run(str(root / "model"), spec, requests, requested, args)}
                    baseline = baseline or row
                    row["vs_no_spec_per_cpu_s"] = row["tokens_per_cpu_s"] / baseline["tokens_per_cpu_s"]
                    row["vs_no_spec_per_step"] = row["tokens_per_step"] / baseline["tokens_per_step"]
                    rows.append(row)
                    logger.warning("%s", row)
    out = Path("results") / f"bench_spec_decode-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": machine_description("cpu"), "args": vars(args), "shape": vars(shape),
                               "rows": rows}, indent=2))
    print(markdown_table(rows, [("workload", "workload", ""), ("adapters", "adapters", "d"), ("method", "method", ""),
                                ("k", "k", "d"),
                                ("output_tokens", "tokens", "d"), ("steps", "steps", "d"), ("proposed", "drafts", "d"),
                                ("tokens_per_cpu_s", "tok/CPU s", ".1f"), ("vs_no_spec_per_cpu_s", "x CPU s", ".2f"),
                                ("tokens_per_step", "tok/step", ".2f"), ("vs_no_spec_per_step", "x step", ".2f"),
                                ("acceptance", "accept", ".2f"), ("mean_accepted_length", "mean len", ".2f")]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
