"""The device run's markdown: what ran, every part's table, and the issue's targets, met or not."""

from __future__ import annotations

import bench_moe_kernels
import gpu_check
import invariant_check
import lora_decode_profile as profile_sections
import spec_rows
from common import markdown_table

# (what, the figure's key in _figures, comparison, bound): issue 37's targets (bf16, graphs on)
TARGETS = [("8 adapters vs base decode, 32 requests", "decode_32_8", ">=", 0.90),
           ("8 adapters vs base decode, 128 requests", "decode_128_8", ">=", 0.90),
           ("32 adapters vs base decode, 32 requests", "decode_32_32", ">=", 0.85),
           ("32 adapters vs base decode, 128 requests", "decode_128_32", ">=", 0.85),
           ("prefill with 8 adapters vs base (smallest over T)", "prefill_8", ">=", 0.85),
           ("LoRA kernel time / base step (profiled replay)", "lora_share", "<=", 0.15),
           ("add_lora at T=128, share of measured bandwidth (best point)", "sgmv_128", ">=", 0.60),
           ("W4A16 batch-1 decode vs bf16", "w4a16_1", ">=", 2.0),
           ("FP8 batch-1 decode vs bf16", "fp8_1", ">=", 1.4)]


# what each part runs in the dry run (CPU, toy sizes) instead of what it measures on the device
DRY_RUN_NOTES = dict(
    tests="collected; every gpu test is skipped without CUDA (no per-test timeout where pytest-timeout is missing)",
    kernels="add_lora's torch path (no Triton, no graph replay): GB/s of a CPU",
    splitk="the Triton split-K shrink under TRITON_INTERPRET=1 at K=256",
    moe="the fused MoE kernels under TRITON_INTERPRET=1 on a toy layer (no graph replay)",
    profile="decode graphs emulated (RerunGraph); 'kernels' are aten ops, no LoRA kernel is named on CPU",
    graphs="RerunGraph replays vs the eager path", prefix="the CPU engine", quant="FP8 and W4A16 on their CPU paths",
    spec="fp32 CPU engines, decode and verify graphs and the draft's graphs emulated (RerunGraph), 2 adapters",
    batch_invariant="the CPU mode (row-blocked GEMMs, per-token attention), not the CUDA kernels")


def _figures(results: dict) -> dict:
    """The figures the targets are about (absent where their part did not run at those sizes)."""
    section, figures = results.get("profile", {}), {}
    for row in section.get("decode", []):
        figures[f"decode_{row['requests']}_{row['adapters']}"] = row["ratio_to_base"]
    prefill = [row["ratio_to_base"] for row in section.get("prefill", []) if row["adapters"]]
    if prefill:
        figures["prefill_8"] = min(prefill)
    replays = section.get("kernels", [])
    if len(replays) == 2 and replays[1]["step_us"] and replays[0]["lora_kernels_per_replay"]:  # none: renamed, or CPU
        figures["lora_share"] = replays[0]["lora_us"] / replays[1]["step_us"]
    sgmv = [row["bandwidth_fraction"] for row in results.get("sgmv", []) if row.get("num_tokens") == 128
            and "bandwidth_fraction" in row]
    if sgmv:
        figures["sgmv_128"] = max(sgmv)
    for row in results.get("quant_decode", []):
        if row["batch"] == 1 and row["weights"] != "bf16" and row.get("vs_bf16") is not None:
            figures[f"{row['weights']}_1"] = row["vs_bf16"]
    return figures


def targets_table(results: dict) -> str:
    figures, rows = _figures(results), []
    for what, key, op, bound in TARGETS:
        value = figures.get(key)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        rows.append(dict(what=what, target=f"{op} {bound:g}", value=value,
                         met="n/a" if met is None else ("met" if met else "NOT met")))
    return markdown_table(rows, [("what", "target", ""), ("target", "bound", ""), ("value", "measured", ".2f"),
                                 ("met", "", "")])


def _decode_bandwidth(results: dict) -> None:
    """Each decode row's weight stream (the model's bytes per step) as GB/s and % of the copy rate."""
    weight_bytes, copy = results.get("model", {}).get("weight_bytes"), results.get("copy_gbps")
    for row in results.get("profile", {}).get("decode", []):
        if weight_bytes and copy and row.get("step_ms"):
            row["weight_gbps"] = weight_bytes / row["step_ms"] / 1e6
            row["weight_share"] = row["weight_gbps"] / copy


def report(results: dict) -> str:
    setup = results.get("setup", {})
    versions = setup.get("versions", {})
    lines = [f"## Device run ({results['mode']}): {setup.get('device', '?')}, {setup.get('date', '?')}, "
             f"{results.get('seconds', 0):.0f} s",
             "", f"torch {versions.get('torch')}, triton {versions.get('triton')}, transformers "
             f"{versions.get('transformers')}, Python {setup.get('python')}; copy bandwidth "
             f"{results.get('copy_gbps', 0):.0f} GB/s (read + write): the % columns are of it", "",
             markdown_table([dict(part=name, **part) for name, part in results["parts"].items()],
                            [("part", "part", ""), ("status", "status", ""), ("seconds", "seconds", ".1f")])]
    if results["mode"] == "dry-run":
        lines += ["", "Dry run: every part ran its code at toy sizes on CPU; on CPU each part runs:",
                  *[f"- {part}: {note}" for part, note in DRY_RUN_NOTES.items()]]
    if "tests" in results:
        run = results["tests"]
        lines += ["", f"gpu tests ({run['files']} files): {run['counts']}, exit {run['returncode']}"
                  + "".join(f"\n- failed: {test}" for test in run["failed"][:20])]
    _decode_bandwidth(results)
    for name, rows, columns in profile_sections.section_tables(results.get("profile", {})):
        if name == "decode":
            columns = columns + [("weight_gbps", "weights GB/s", ".0f"), ("weight_share", "% of copy", ".0%")]
        if rows:
            lines += ["", f"### {name}", markdown_table(rows, columns)]
    replays = results.get("profile", {}).get("kernels", [])
    if replays:
        per_kernel = [dict(name=name[:60], **stats) for name, stats in replays[0]["per_kernel"].items()]
        lines += ["", f"### us per kernel in one replay of {replays[0]['key'][:80]}",
                  markdown_table(per_kernel, [("name", "kernel", ""), ("us", "us", ".1f"), ("calls", "calls", ".0f")])]
    if results.get("sgmv"):
        lines += ["", "### add_lora (SGMV shrink + expand)", *gpu_check.kernel_table(
            dict(kernels=results["sgmv"], copy_gbps=results.get("copy_gbps", 0)))]
    tables = [("split-K determinism", results.get("splitk"), [
        ("tokens", "T", "d"), ("hidden", "K", "d"), ("split_k", "splits", "d"), ("repeats", "repeats", "d"),
        ("differing", "differing outputs", "d")]),
        ("fused MoE vs per-expert torch loop (Qwen3-30B-A3B layer)", results.get("moe_kernels"),
         bench_moe_kernels.COLUMNS),
        ("graphs vs eager (one engine)", results.get("graphs_vs_eager"), [
            ("requests", "requests", "d"), ("adapters", "adapters", "d"), ("graph_replays", "replays", "d"),
            ("repeat_identical", "graphs repeat", ""), ("same_as_eager", "same as eager", ".0%"),
            ("graphs_tok_s", "graphs tok/s", ".0f"), ("eager_tok_s", "eager tok/s", ".0f")]),
        ("prefix-cache TTFT", [results["prefix_cache"]] if "prefix_cache" in results else None, [
            ("prefix_len", "prefix tokens", "d"), ("cold_ttft_ms", "cold TTFT ms", ".1f"),
            ("warm_ttft_ms", "cached TTFT ms", ".1f"), ("speedup", "x", ".2f")]),
        ("decode by weight format (no adapters, graphs)", results.get("quant_decode"), [
            ("weights", "weights", ""), ("batch", "batch", "d"), ("tokens_per_s", "tok/s", ".0f"),
            ("vs_bf16", "vs bf16", ".2f")]),
        ("speculative decoding (grounded prompts, greedy, graphs)", results.get("spec_decode"), spec_rows.COLUMNS),
        ("batch-invariant mode vs default (4 adapters, graphs)", results.get("batch_invariant"),
         invariant_check.COLUMNS)]
    for title, rows, columns in tables:
        if rows:
            lines += ["", f"### {title}", markdown_table(rows, columns)]
    lines += ["", "### targets" + (" (toy sizes on CPU: plumbing, not a measurement)" if results["mode"] == "dry-run"
                                   else ""), targets_table(results)]
    lines += [f"\n{name}: {status['status']}" for name, status in results["parts"].items()
              if status["status"] != "ok"]
    return "\n".join(lines)
