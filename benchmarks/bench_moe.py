"""Engine decode and prefill speed on a small random mixture-of-experts model, with expert LoRAs,
against PEFT and transformers (bench_step's decode and prefill tables, for MoE; issue 34).

One torch thread, this process's CPU time, best of --repeats interleaved runs. The model: a random
Qwen3-MoE (or Mixtral, --family) written by transformers itself, 4 layers, hidden 256, 16 experts,
top-4, expert intermediate 128, the tiny models' 256-token vocabulary. Two sets of 8 adapters, written
by PEFT with random A and B, ranks 8 and 16 alternating:

  expert LoRAs     q_proj/v_proj and `target_parameters` on the fused experts
                   (mlp.experts.gate_up_proj, mlp.experts.down_proj)
  attention LoRAs  q_proj/v_proj only: the same attention LoRA without the experts, for comparison

Rows: transformers (base), the engine base-only, with the 8 expert LoRAs and with the 8 attention
LoRAs (request i uses adapter i % 8), the engine with online FP8 weights (quantization="fp8": experts,
attention and dense MLPs float8_e4m3fn with a float32 scale per output channel; the router float)
base-only and with the 8 expert LoRAs, and PEFT with each set. PEFT refuses a mixed-adapter batch
(`adapter_names=`) on a `target_parameters` LoRA ("lora.ParamWrapper does not support mixed adapter
batches yet", PEFT 0.21), so its expert row runs what a PEFT user can: one sub-batch per adapter
(`set_adapter`), the times summed; its attention row is its mixed batch. The engine computes in
float32 throughout (dtype="float32"; FP8 is weight-only on the CPU).

  decode tok/s   --batch equal-length prompts, greedy, EOS ignored: engine steps after every
                 request has its first token; for generate, (time of n new tokens - time of 1).
  prefill tok/s  8 sequences of --prefill-tokens / 8 tokens prefilled in ONE engine step; the
                 transformers / PEFT forward of the same batch keeping the last logits only; fresh
                 prompts every run (no prefix-cache hits), after one warm-up run each.
  same tokens    each engine row against its reference (base: transformers; expert / attention
                 LoRAs: PEFT with the same adapters): all decoded tokens equal per request, up to
                 the engine's first EOS, which generate's min_new_tokens forbids (decode); greedy
                 first token equal (prefill). The FP8 rows' reference is the FP8 oracle, run once
                 per batch and not timed: transformers with every weight the engine quantizes
                 replaced by its dequantized FP8 value (PEFT's per-adapter batches on it for the
                 expert LoRAs): tests/quant_support.fp8_oracle, tests/test_moe_fp8.py's.
  expert memory  bytes of the routed experts' weights (FP8: with their scales) in the engine's
                 model, float32 and quantization="fp8".

    python benchmarks/bench_moe.py             # ~1.5 min on one busy CPU core
    python benchmarks/bench_moe.py --quick     # fewer tokens and repeats, ~30 s
    python benchmarks/bench_moe.py --smoke     # a 2-layer model in seconds: the plumbing, not speed
    python benchmarks/bench_moe.py --family mixtral

Writes results/bench_moe-<time>.json.
"""

from __future__ import annotations

import argparse
import copy
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench_step import (PROMPT_LEN, EnginePrefill, _faster, engine_decode,  # benchmarks/bench_step.py
                        forward_run, generate_decode, peft_with_adapters)
from common import (FIRST_ORDINARY_TOKEN, machine_description, markdown_table, save_word_tokenizer, start_cpu_run,
                    write_report)

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))  # quant_support: the FP8 oracle, the tests' own
logger = logging.getLogger("bench_moe")

NUM_ADAPTERS = 8
RANKS = (8, 16)  # adapter i has rank RANKS[i % 2]; bench_step's engines hold rank 16
PREFILL_SEQUENCES = 8
VOCAB_SIZE = 256
EOS = 2  # the configs' eos_token_id
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTER_KINDS = {"expert": dict(target_modules=["q_proj", "v_proj"], target_parameters=EXPERT_PARAMETERS),
                 "attention": dict(target_modules=["q_proj", "v_proj"])}
SHAPES = {  # (layers, hidden, experts, top-k, expert intermediate)
    "default": (4, 256, 16, 4, 128),
    "smoke": (2, 64, 8, 2, 32),
}

DECODE_COLUMNS = [("run", "run", ""), ("batch", "batch", "d"), ("new_tokens", "new tokens", "d"),
                  ("decode_tokens_per_s", "decode tok/s", ".1f"), ("total_tokens_per_s", "total tok/s", ".1f"),
                  ("vs_transformers", "vs transformers", ".2f"), ("vs_engine_base", "vs engine base", ".2f"),
                  ("vs_peft", "vs PEFT (same adapters)", ".2f"), ("same_tokens", "same tokens", ".0%")]
PREFILL_COLUMNS = [("run", "run", ""), ("sequences", "sequences", "d"), ("tokens", "tokens", "d"),
                   ("prefill_tokens_per_s", "prefill tok/s", ".1f"),
                   ("vs_transformers", "vs transformers", ".2f"), ("vs_engine_base", "vs engine base", ".2f"),
                   ("vs_peft", "vs PEFT (same adapters)", ".2f"), ("same_first_token", "same first token", ".0%")]
MEMORY_COLUMNS = [("weights", "expert weights", ""), ("bytes", "bytes", "d"), ("mib", "MiB", ".2f"),
                  ("vs_float32", "vs float32", ".3f")]


class EngineRow(NamedTuple):
    """An engine row: its adapters, its weights' online quantization, the row its tokens must equal and the
    PEFT row of the same adapters (its speed's comparison)."""

    kind: str | None  # ADAPTER_KINDS key, None: base only
    quantization: str | None
    reference: str  # a table row, or an ORACLE_ROWS one
    peft: str | None


PEFT_EXPERT, PEFT_ATTENTION = "PEFT 8 expert LoRAs (per-adapter batches)", "PEFT 8 attention LoRAs (mixed batch)"
ENGINE_ROWS = {"engine base": EngineRow(None, None, "transformers (base)", None),
               "engine 8 expert LoRAs": EngineRow("expert", None, PEFT_EXPERT, PEFT_EXPERT),
               "engine 8 attention LoRAs": EngineRow("attention", None, PEFT_ATTENTION, PEFT_ATTENTION),
               "engine FP8 base": EngineRow(None, "fp8", "FP8 oracle (base)", None),
               "engine FP8 8 expert LoRAs": EngineRow("expert", "fp8", "FP8 oracle 8 expert LoRAs", PEFT_EXPERT)}
PEFT_ROWS = {PEFT_EXPERT: "expert", PEFT_ATTENTION: "attention"}
# references that are not timed: transformers / PEFT over the dequantized FP8 weights (Workbench.fp8_hf/fp8_peft)
ORACLE_ROWS = ("FP8 oracle (base)", "FP8 oracle 8 expert LoRAs")
ROWS = ["transformers (base)", *ENGINE_ROWS, *PEFT_ROWS]  # the tables' order


def moe_config(family: str, shape: str):
    """The transformers config of a random `family` model of SHAPES[shape]."""
    import transformers

    layers, hidden, experts, top_k, expert_intermediate = SHAPES[shape]
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=top_k, max_position_embeddings=4096,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=EOS,
                  initializer_range=0.1)  # peakier logits than 0.02: fewer near-ties in greedy decoding
    if family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=experts, intermediate_size=expert_intermediate)
    return transformers.Qwen3MoeConfig(**common, num_experts=experts, moe_intermediate_size=expert_intermediate,
                                       intermediate_size=4 * expert_intermediate, head_dim=hidden // 4,
                                       norm_topk_prob=True)


def save_moe_model(path: Path, family: str, shape: str, seed: int = 0):
    """Write a random MoE causal LM (transformers' own save_pretrained, fp32) and a word-level
    tokenizer; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_config(family, shape), dtype=torch.float32).eval()
    model.save_pretrained(str(path))
    save_word_tokenizer(path, VOCAB_SIZE)
    logger.info("random %s %s: %.2fM parameters", family, SHAPES[shape], model.num_parameters() / 1e6)
    return model


def save_adapters(base_model, root: Path, kind: str, seed: int) -> list[Path]:
    """Write NUM_ADAPTERS PEFT LoRAs of ADAPTER_KINDS[kind] with random A and B, ranks RANKS
    alternating; returns their directories."""
    from peft import LoraConfig, get_peft_model

    gen = torch.Generator().manual_seed(seed)
    models = {r: get_peft_model(copy.deepcopy(base_model), LoraConfig(
        r=r, lora_alpha=2 * r, lora_dropout=0.0, init_lora_weights=False, **ADAPTER_KINDS[kind])) for r in RANKS}
    paths = []
    for i in range(NUM_ADAPTERS):
        peft_model = models[RANKS[i % len(RANKS)]]
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:  # A ~ N(0, 1/in) keeps A x at unit scale; a small B keeps the delta a perturbation
                    std = param.shape[1] ** -0.5 if "lora_A" in name else 0.02
                    param.copy_(torch.randn(param.shape, generator=gen) * std)
        paths.append(root / f"{kind}-{i:03d}")
        peft_model.save_pretrained(str(paths[-1]))
    return paths


def expert_memory(model_dir: str) -> list[dict]:
    """The bytes of the routed experts' weights (and FP8 scales) in the engine's model, float32 and FP8."""
    from lora_runner.model import load_model
    from lora_runner.model.moe import SparseMoeBlock

    rows = []
    for quantization in (None, "fp8"):
        model, _, _ = load_model(model_dir, dtype=torch.float32, quantization=quantization)
        size = sum(t.numel() * t.element_size() for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)
                   for expert in layer.mlp.experts for linear in (expert.gate_up, expert.down)
                   for t in (linear.weight, getattr(linear, "weight_scale", None)) if t is not None)
        rows.append({"weights": "float32" if quantization is None else "fp8 (+ float32 scales)", "bytes": size,
                     "mib": size / 2**20, "vs_float32": size / rows[0]["bytes"] if rows else 1.0})
        del model
    return rows


def adapter_groups(num_rows: int) -> dict[str, list[int]]:
    """{PEFT adapter name: its rows}, request i on adapter i % NUM_ADAPTERS (as the engine's)."""
    return {f"a{a}": list(range(a, num_rows, NUM_ADAPTERS)) for a in range(min(NUM_ADAPTERS, num_rows))}


def peft_grouped_decode(model, prompts: list[list[int]], new_tokens: int) -> dict:
    """PEFT generate once per adapter on its rows (set_adapter), as a PEFT user must where a mixed
    batch is refused; decode and total seconds summed over the sub-batches."""
    decode_s = total_s = 0.0
    token_ids = [None] * len(prompts)
    for name, rows in adapter_groups(len(prompts)).items():
        model.set_adapter(name)
        result = generate_decode(model, [prompts[i] for i in rows], new_tokens)
        decode_s += len(rows) * (new_tokens - 1) / result["decode_tokens_per_s"]
        total_s += len(rows) * new_tokens / result["total_tokens_per_s"]
        for i, ids in zip(rows, result["token_ids"]):
            token_ids[i] = ids
    return {"decode_tokens_per_s": len(prompts) * (new_tokens - 1) / decode_s,
            "total_tokens_per_s": len(prompts) * new_tokens / total_s, "token_ids": token_ids}


def peft_grouped_forward(model, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """PEFT's forward once per adapter on its sequences (set_adapter): summed CPU seconds and each
    sequence's greedy next token."""
    seconds, first = 0.0, [None] * len(prompts)
    for name, rows in adapter_groups(len(prompts)).items():
        model.set_adapter(name)
        part_s, tokens = forward_run(model, [prompts[i] for i in rows])
        seconds += part_s
        for i, token in zip(rows, tokens):
            first[i] = token
    return seconds, first


class Workbench:
    """The model directory, both adapter sets and the transformers / PEFT models over them, and the FP8
    oracle's (transformers over the dequantized FP8 weights, PEFT's expert LoRAs on it)."""

    def __init__(self, tmp: Path, args) -> None:
        from quant_support import fp8_oracle
        from transformers import AutoModelForCausalLM

        self.model_dir = str(tmp / "model")
        base = save_moe_model(tmp / "model", args.family, args.shape)
        self.adapters = {kind: save_adapters(base, tmp / "adapters", kind, seed=i)
                         for i, kind in enumerate(ADAPTER_KINDS)}
        del base
        self.hf = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.peft = {kind: peft_with_adapters(self.model_dir, paths) for kind, paths in self.adapters.items()}
        fp8_oracle(self.hf).save_pretrained(str(tmp / "fp8-oracle"))
        self.fp8_hf = AutoModelForCausalLM.from_pretrained(str(tmp / "fp8-oracle"), dtype=torch.float32).eval()
        self.fp8_peft = peft_with_adapters(str(tmp / "fp8-oracle"), self.adapters["expert"])

    def paths(self, kind: str | None) -> list[Path]:
        """The adapter directories of `kind` (none for the base)."""
        return self.adapters[kind] if kind else []


def decode_runs(bench: Workbench, prompts: list[list[int]], new_tokens: int) -> dict:
    """{row: callable returning that row's decode result}: every row of the decode table."""
    names = [f"a{i % NUM_ADAPTERS}" for i in range(len(prompts))]
    runs = {"transformers (base)": lambda: generate_decode(bench.hf, prompts, new_tokens),
            PEFT_EXPERT: lambda: peft_grouped_decode(bench.peft["expert"], prompts, new_tokens),
            PEFT_ATTENTION: lambda: generate_decode(bench.peft["attention"], prompts, new_tokens, adapter_names=names)}
    for row, spec in ENGINE_ROWS.items():
        runs[row] = (lambda spec=spec: engine_decode(bench.model_dir, bench.paths(spec.kind), prompts, new_tokens,
                                                     NUM_ADAPTERS if spec.kind else 0, spec.quantization))
    return {row: runs[row] for row in ROWS}


def oracle_decode(bench: Workbench, prompts: list[list[int]], new_tokens: int) -> dict[str, list[list[int]]]:
    """{ORACLE_ROWS row: its greedy tokens for each prompt}, run once (not timed)."""
    tokens = dict(zip(ORACLE_ROWS, (generate_decode(bench.fp8_hf, prompts, new_tokens),
                                    peft_grouped_decode(bench.fp8_peft, prompts, new_tokens))))
    return {row: result["token_ids"] for row, result in tokens.items()}


def decode_table(bench: Workbench, args) -> list[dict]:
    """Decode and end-to-end tokens per CPU second of every row, best of args.repeats interleaved."""
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(FIRST_ORDINARY_TOKEN, VOCAB_SIZE, (args.batch, PROMPT_LEN), generator=gen).tolist()
    runs = decode_runs(bench, prompts, args.new_tokens)
    best = dict.fromkeys(runs)
    for repeat in range(args.repeats):  # interleaved: a busy machine slows every row alike
        for row, run in runs.items():
            best[row] = _faster(best[row], run())
        logger.info("decode run %d: %s", repeat, {row: round(r["decode_tokens_per_s"], 1) for row, r in best.items()})
    tokens = {**{row: result["token_ids"] for row, result in best.items()},
              **oracle_decode(bench, prompts, args.new_tokens)}
    return [table_row(row, best, "decode_tokens_per_s", batch=args.batch, new_tokens=args.new_tokens,
                      total_tokens_per_s=best[row]["total_tokens_per_s"], same_tokens=same_fraction(row, tokens))
            for row in best]


def table_row(row: str, results: dict, key: str, **extra) -> dict:
    """One table row: `key` of results[row] and its ratios to transformers, the engine base and the
    PEFT row with the same adapters (None for base rows)."""
    value = results[row][key]
    peft_row = ENGINE_ROWS[row].peft if row in ENGINE_ROWS else (row if row in PEFT_ROWS else None)
    return {"run": row, key: value, "vs_transformers": value / results["transformers (base)"][key],
            "vs_engine_base": value / results["engine base"][key],
            "vs_peft": value / results[peft_row][key] if peft_row else None, **extra}


def same_fraction(row: str, tokens: dict) -> float | None:
    """The fraction of sequences whose tokens equal the reference row's (engine rows only), up to the
    engine's first EOS: generate's min_new_tokens forbids EOS where the engine (ignore_eos) may pick it."""
    if row not in ENGINE_ROWS:
        return None
    reference = tokens[ENGINE_ROWS[row].reference]
    cuts = [ids.index(EOS) if EOS in ids else len(ids) for ids in tokens[row]]
    return sum(a[:cut] == b[:cut] for a, b, cut in zip(tokens[row], reference, cuts)) / len(reference)


def prefill_table(bench: Workbench, args) -> list[dict]:
    """Prefill tokens per CPU second of PREFILL_SEQUENCES sequences in one engine step (one
    forward for transformers / PEFT), best of args.repeats after a warm-up run."""
    num_tokens = args.prefill_tokens // PREFILL_SEQUENCES * PREFILL_SEQUENCES
    names = [f"a{i % NUM_ADAPTERS}" for i in range(PREFILL_SEQUENCES)]
    engines = {row: EnginePrefill(bench.model_dir, bench.paths(spec.kind), num_tokens,
                                  NUM_ADAPTERS if spec.kind else 0, spec.quantization)
               for row, spec in ENGINE_ROWS.items()}
    runs = {"transformers (base)": lambda p: forward_run(bench.hf, p),
            PEFT_EXPERT: lambda p: peft_grouped_forward(bench.peft["expert"], p),
            PEFT_ATTENTION: lambda p: forward_run(bench.peft["attention"], p, adapter_names=names),
            **{row: engine.run for row, engine in engines.items()}}
    runs = {row: runs[row] for row in ROWS}
    best, same = dict.fromkeys(runs, float("inf")), dict.fromkeys(ENGINE_ROWS, 0)
    for repeat in range(args.repeats + 1):  # interleaved; the first run of each warms up
        gen = torch.Generator().manual_seed(100 + repeat)  # fresh prompts: no prefix-cache hits
        prompts = torch.randint(FIRST_ORDINARY_TOKEN, VOCAB_SIZE, (PREFILL_SEQUENCES, num_tokens // PREFILL_SEQUENCES),
                                generator=gen).tolist()
        results = {row: run(prompts) for row, run in runs.items()}
        for row, (seconds, _) in results.items():
            best[row] = min(best[row], seconds) if repeat else best[row]
        results.update(zip(ORACLE_ROWS, (forward_run(bench.fp8_hf, prompts),  # not timed
                                         peft_grouped_forward(bench.fp8_peft, prompts))))
        for row, spec in ENGINE_ROWS.items():
            same[row] += sum(a == b for a, b in zip(results[row][1], results[spec.reference][1]))
        logger.info("prefill run %d: %s", repeat, {row: round(s, 3) for row, s in best.items()})
    for engine in engines.values():
        engine.engine.close()
    rates = {row: {"prefill_tokens_per_s": num_tokens / seconds} for row, seconds in best.items()}
    checked = PREFILL_SEQUENCES * (args.repeats + 1)
    return [table_row(row, rates, "prefill_tokens_per_s", sequences=PREFILL_SEQUENCES, tokens=num_tokens,
                      same_first_token=same[row] / checked if row in same else None) for row in rates]


def parse_args(argv=None):
    """Command-line options; --quick and --smoke set the sizes they name."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=("qwen3_moe", "mixtral"), default="qwen3_moe")
    p.add_argument("--batch", type=int, default=16, help="requests of the decode table (adapters round-robin)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--prefill-tokens", type=int, default=1024,
                   help=f"tokens of the prefill table's one step, over {PREFILL_SEQUENCES} sequences")
    p.add_argument("--repeats", type=int, default=3, help="runs of each row; the fastest counts")
    p.add_argument("--quick", action="store_true", help="16 new tokens, 512 prefill tokens, 2 repeats")
    p.add_argument("--smoke", action="store_true", help="a 2-layer model, 8 requests, 4 tokens, 1 repeat")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out-dir", default="results")
    args = p.parse_args(argv)
    args.shape = "smoke" if args.smoke else "default"
    if args.quick:
        args.new_tokens, args.prefill_tokens, args.repeats = 16, 512, 2
    if args.smoke:
        args.batch, args.new_tokens, args.prefill_tokens, args.repeats = 8, 4, 64, 1
    if args.new_tokens < 2 or args.prefill_tokens < PREFILL_SEQUENCES or args.batch < 1:
        p.error(f"--new-tokens must be at least 2, --prefill-tokens at least {PREFILL_SEQUENCES}, --batch positive")
    return args


def main(argv=None) -> dict:
    """Run the benchmark; returns the report (also written as JSON)."""
    args = parse_args(argv)
    started = start_cpu_run(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_moe-") as tmp:
        bench = Workbench(Path(tmp), args)
        decode = [] if args.skip_decode else decode_table(bench, args)
        prefill = [] if args.skip_prefill else prefill_table(bench, args)
        memory = expert_memory(bench.model_dir)
    layers, hidden, experts, top_k, expert_intermediate = SHAPES[args.shape]
    report = {"clock": "process", "machine": machine_description("cpu"), "family": args.family,
              "model": dict(layers=layers, hidden=hidden, experts=experts, top_k=top_k,
                            expert_intermediate=expert_intermediate, vocab=VOCAB_SIZE),
              "adapters": dict(num=NUM_ADAPTERS, ranks=RANKS, kinds=ADAPTER_KINDS),
              "seconds": time.perf_counter() - started, "decode": decode, "prefill": prefill,
              "expert_memory": memory}
    path = write_report(report, args.out_dir, "bench_moe")
    print(f"{args.family}: {layers} layers, hidden {hidden}, {experts} experts, top-{top_k}, expert intermediate "
          f"{expert_intermediate}; {NUM_ADAPTERS} adapters of ranks {'/'.join(map(str, RANKS))}")
    if decode:
        print("\ndecode:\n" + markdown_table(decode, DECODE_COLUMNS))
    if prefill:
        print(f"\nprefill of {PREFILL_SEQUENCES} sequences in one step:\n" + markdown_table(prefill, PREFILL_COLUMNS))
    print("\nrouted experts' weights in the engine's model:\n" + markdown_table(memory, MEMORY_COLUMNS))
    print(f"\nCPU seconds of this process, {args.threads} torch thread(s); written {path}")
    return report


if __name__ == "__main__":
    main()
