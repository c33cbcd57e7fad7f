"""benchmarks/gpu_check.py --cpu-smoke: every section of the GPU check runs on CPU at tiny sizes
(torch LoRA backend, CUDA graphs emulated) and writes its JSON."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_cpu_smoke(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| section | status | seconds |" in proc.stdout
    assert "| 8 | 4 |" in proc.stdout  # the engine table's last row (8 requests, 4 adapters)
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {name: s["status"] for name, s in results["sections"].items()} == {
        "tests": "ok", "kernels": "ok", "engine": "ok"}, results.get("errors")
    counts = results["tests"]["counts"]
    assert counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("passed")  # no CUDA here
    kernels = results["kernels"]
    assert len(kernels) == 4 and all(row["lora_gbps"] > 0 and row["speedup_vs_gather"] > 0 for row in kernels)
    engine = results["engine"]
    assert sorted(engine) == sorted(f"{n}/{a}" for n in (4, 8) for a in (0, 2, 4))
    for key, modes in engine.items():
        num_requests = int(key.split("/")[0])
        for mode in ("eager", "graphs"):
            run = modes[mode]
            assert run["decode_tokens"] == num_requests * 3 and run["tokens_per_s"] > 0, (key, mode)
        assert modes["eager"]["graph_replays"] == 0 and modes["graphs"]["graph_replays"] == 3, key
    setup = results["engine_setup"]
    assert setup["eager"]["num_graphs"] == 0 and setup["graphs"]["num_graphs"] == 8  # sizes 1, 2, 4, 8 x LoRA or not
