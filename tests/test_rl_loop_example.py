"""examples/rl_loop.py runs: every step pushes a new version from memory and samples name it."""

from __future__ import annotations

from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def test_the_rl_loop_pushes_a_new_version_each_step_and_samples_name_it(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import rl_loop

    threads = torch.get_num_threads()
    try:
        records = rl_loop.run(steps=3, samples_per_prompt=2, max_tokens=4)  # run() asserts each sample's version
    finally:
        torch.set_num_threads(threads)
    versions = [record["version"] for record in records]
    assert len(versions) == 3 and versions == sorted(set(versions))
    assert all(0.0 <= record["reward"] <= 1.0 and record["update_s"] > 0 for record in records)
