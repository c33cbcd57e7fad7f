"""benchmarks/bench_moe.py --smoke: the MoE decode and prefill tables on a 2-layer random Qwen3-MoE, every row
timed and every engine row's tokens equal to its reference's (transformers for the base, PEFT for the 8 expert
LoRAs and the 8 attention LoRAs): the plumbing of the benchmark and a check of the expert LoRA's numbers, not speed."""

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
    assert "| engine 8 expert LoRAs |" in capsys.readouterr().out
