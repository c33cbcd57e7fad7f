"""The README tells the truth where a script can check it: the benchmark table has the columns
bench_engine.py prints, the bandwidth share is of the figure gpu_check.py uses (the H200's 4.8 TB/s),
and the Python example takes its token ids from the tokenizer of the model it names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _module_constant(path: Path, name: str):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not found in {path}")


def test_the_quick_benchmark_table_has_the_columns_the_script_prints():
    headers = [header for _, header, _ in _module_constant(REPO / "benchmarks" / "bench_engine.py", "COLUMNS")]
    table_header = next(line for line in README.splitlines() if line.startswith("| workload |"))
    assert [cell.strip() for cell in table_header.strip("|").split("|")] == headers


def test_the_attention_table_uses_the_h200_hbm_bandwidth():
    hbm = _module_constant(REPO / "benchmarks" / "gpu_check.py", "HBM_GBPS")
    assert hbm == 4800.0
    assert f"GB/s (of {hbm:.0f})" in README and "of 4300)" not in README
    for gbps, share in re.findall(r"\| (\d+) \((\d+)%\) \|", README):
        assert round(100 * int(gbps) / hbm) == int(share)


def test_the_python_example_has_no_token_ids_of_another_model():
    example = README[README.index("## Python API"):README.index("Chat models:")]
    assert not re.search(r"\[\d+, \d+", example), "literal token ids belong to one tokenizer: derive them"
    assert "tokenizer" in example


def test_the_opening_claims_only_measured_costs():
    opening = README[:README.index("## Set-up")]
    assert "costs about what serving" not in opening
    for ratio in re.findall(r"(\d\.\d\d)x", opening):
        assert f"| {ratio} |" in README, f"{ratio}x in the opening is in no table"
