"""benchmarks/gpu_check.py --cpu-smoke: every section of the GPU check runs on CPU at tiny sizes
(torch LoRA backend, CUDA graphs emulated) and writes its JSON; its results are checked, not just
its completion: the graphed engine decodes the eager engine's tokens, every kernel point passed
bench_point's check against the gather+bmm reference, and every figure is finite and consistent
with the byte count it claims."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402 -- benchmarks/ is a script folder
from bench_kernels import lora_bytes  # noqa: E402

SMOKE_HIDDEN, SMOKE_TOKENS, SMOKE_RANKS, SMOKE_DISTINCT = 128, (1, 16), (16,), (1, 8)  # gpu_check.CPU_SMOKE
ENGINE_POINTS = [(n, a) for n in (4, 8) for a in (0, 2, 4)]


def numbers(tree, path=""):
    """(path, value) of every number in a JSON tree."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from numbers(value, f"{path}/{key}")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from numbers(value, f"{path}/{i}")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


def engine_rows(stdout: str) -> dict[tuple[int, int], list[str]]:
    """The printed engine table: (requests, adapters) -> its cells (the JSON drops the token ids,
    so the eager/graphs comparison is read from here)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 8 and cells[0].isdigit() and re.fullmatch(r"\d+%", cells[-1]):
            rows[int(cells[0]), int(cells[1])] = cells
    return rows


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--cpu-smoke"], cwd=ROOT,
                          env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow  # shares one ~30-60 s gpu_check subprocess
def test_every_section_ran_and_every_figure_is_finite(smoke):
    stdout, results = smoke
    assert {name: s["status"] for name, s in results["sections"].items()} == {
        "tests": "ok", "kernels": "ok", "engine": "ok"}, results.get("errors")
    assert "| section | status | seconds |" in stdout
    counts = results["tests"]["counts"]
    assert counts.get("skipped", 0) > 0 and not counts.get("failed") and not counts.get("passed")  # no CUDA here
    values = list(numbers({key: results[key] for key in ("kernels", "engine", "engine_setup")}))
    assert len(values) > 50 and all(math.isfinite(value) for _, value in values), values


@pytest.mark.slow  # shares one ~30-60 s gpu_check subprocess
def test_kernel_points_match_the_reference_and_their_byte_counts(smoke):
    """bench_point asserts add_lora == gather+bmm before it times anything (a mismatch becomes an
    error row and fails the section); each row's GB/s and speedup follow from its own timings."""
    _, results = smoke
    kernels = results["kernels"]
    grid = [(t, r, d) for t in SMOKE_TOKENS for r in SMOKE_RANKS for d in SMOKE_DISTINCT]
    assert [(row["num_tokens"], row["rank"], row["distinct"]) for row in kernels] == grid
    for row in kernels:
        assert "error" not in row, row
        present = min(row["distinct"], row["num_tokens"])
        assert row["present"] == present
        assert row["bytes"] == lora_bytes(row["num_tokens"], row["rank"], present, SMOKE_HIDDEN, 4)  # fp32
        assert row["graph_us"] is None  # no CUDA graphs of the kernels on CPU
        assert row["lora_us"] > 0 and row["gather_us"] > 0 and row["base_us"] > 0
        assert row["lora_gbps"] == pytest.approx(row["bytes"] / row["lora_us"] / 1e3, rel=1e-9)
        assert row["speedup_vs_gather"] == pytest.approx(row["gather_us"] / row["lora_us"], rel=1e-9)


@pytest.mark.slow  # shares one ~30-60 s gpu_check subprocess
def test_graphed_engine_decodes_the_eager_tokens(smoke):
    """Emulated decode graphs (captured with a warmup adapter, replayed with 0, 2 or 4 distinct
    adapters) give exactly the eager engine's greedy tokens, and every decode step replays."""
    stdout, results = smoke
    rows = engine_rows(stdout)
    assert sorted(rows) == ENGINE_POINTS
    for (num_requests, num_adapters), cells in rows.items():
        assert cells[-1] == "100%", cells  # same tokens, eager vs graphs, for every request
        modes = results["engine"][f"{num_requests}/{num_adapters}"]
        for mode in ("eager", "graphs"):
            run = modes[mode]
            assert run["decode_tokens"] == num_requests * 3 and run["tokens_per_s"] > 0, (cells, mode)
            assert run["tokens_per_s"] == pytest.approx(run["decode_tokens"] / run["seconds"], rel=1e-9)
        assert modes["eager"]["graph_replays"] == 0 and modes["graphs"]["graph_replays"] == 3, cells
    assert sorted(results["engine"]) == sorted(f"{n}/{a}" for n, a in ENGINE_POINTS)
    setup = results["engine_setup"]
    # sizes 1, 2, 4, 8 x (base, plain LoRA, LoRA with the embedding and DoRA work)
    assert setup["eager"]["num_graphs"] == 0 and setup["graphs"]["num_graphs"] == 12


def test_graphed_engine_with_distinct_adapters_decodes_the_eager_tokens(monkeypatch, tmp_path):
    """The smoke's engine section in-process, with adapters that differ from each other and
    change the tokens. gpu_check's dummy adapters are at scale 0.01, too small to move its
    eager/graphs token comparison when a graph reads the wrong slot; these at 0.1 do."""
    import adapters.manager

    real_dummy = adapters.manager.dummy_lora
    monkeypatch.setattr(adapters.manager, "dummy_lora", lambda name, spec, rank, dtype, **_: real_dummy(
        name, spec, rank, dtype, scale=0.1, seed=zlib.crc32(name.encode())))
    sizes = dataclasses.replace(gpu_check.CPU_SMOKE, output_len=6)
    gpu_check.write_random_model(tmp_path, sizes)
    tokens = {}
    for mode in ("eager", "graphs"):
        engine = gpu_check.make_engine(tmp_path, sizes, graphs=mode == "graphs")
        for num_adapters in (0, 4):
            run = gpu_check.decode_run(engine, sizes, 8, num_adapters, f"{mode}-{num_adapters}")
            tokens[mode, num_adapters] = run["token_ids"]
        if mode == "graphs":
            assert engine.runner.decode_graphs.num_replays >= 2 * (sizes.output_len - 1)
        engine.close()
    assert tokens["graphs", 0] == tokens["eager", 0]
    assert tokens["graphs", 4] == tokens["eager", 4]
    with_lora, base = tokens["eager", 4], tokens["eager", 0]
    assert sum(a != b for a, b in zip(with_lora, base)) >= 6  # the adapters change most requests
