"""benchmarks/bench_moe.py --smoke: the MoE decode and prefill tables on a 2-layer random Qwen3-MoE, every row
timed and every engine row's tokens equal to its reference's (transformers for the base, PEFT for the 8 expert
LoRAs and the 8 attention LoRAs, the FP8 oracle over dequantized weights for the online-FP8 rows), and the
experts' bytes in FP8: the plumbing of the benchmark and a check of the expert LoRA's numbers, not speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters
def test_smoke_writes_both_tables_with_engine_tokens_equal_to_peft(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_moe

    threads = torch.get_num_threads()
    try:
        report = bench_moe.main(["--smoke", "--out-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)  # main pins the process to --threads
    assert json.loads(next(tmp_path.glob("bench_moe-*.json")).read_text())["decode"] == report["decode"]
    for table, rate, same in (("decode", "decode_tokens_per_s", "same_tokens"),
                              ("prefill", "prefill_tokens_per_s", "same_first_token")):
        rows = {row["run"]: row for row in report[table]}
        assert list(rows) == bench_moe.ROWS
        assert all(row[rate] > 0 and row["vs_engine_base"] > 0 for row in rows.values())
        assert {run: rows[run][same] for run in bench_moe.ENGINE_ROWS} == dict.fromkeys(bench_moe.ENGINE_ROWS, 1.0)
    float32, fp8 = report["expert_memory"]
    # one byte a weight and a float32 scale a row (K = 64 and 32 here), against four bytes a weight
    assert 0.25 < fp8["bytes"] / float32["bytes"] == fp8["vs_float32"] <= 0.3, report["expert_memory"]
    out = capsys.readouterr().out
    assert "| engine 8 expert LoRAs |" in out and "| engine FP8 8 expert LoRAs |" in out
