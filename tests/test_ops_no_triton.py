"""The package imports and serves on CPU without triton (an extra since issue 24: GPU kernels only).

A subprocess hides triton behind a meta-path blocker (as if it were not installed), imports
lora_runner and the server, and runs a tiny generate with a LoRA on the engine test checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

BLOCKED_RUN = textwrap.dedent("""
    import importlib.abc, json, sys

    class NoTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)", name=name)
            return None

    sys.meta_path.insert(0, NoTriton())
    import lora_runner
    import lora_runner.entrypoints.cli  # the server's modules too
    import punica_kernels
    from adapters import LoRARequest
    from lora_runner import LLM, SamplingParams

    model, lora = sys.argv[1], sys.argv[2]  # -c: argv[0] is '-c', cwd (the repo) is on sys.path
    llm = LLM(model=model, device="cpu", dtype="float32", max_model_len=64, max_loras=1, max_lora_rank=16)
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.0, max_tokens=3),
                        lora_request=[LoRARequest("a", lora), None])
    print(json.dumps({"triton_available": punica_kernels.ops.triton_available(),
                      "triton_imported": any(m == "triton" or m.startswith("triton.") for m in sys.modules),
                      "tokens": [o.outputs[0].token_ids for o in outs]}))
""")


def test_import_and_generate_without_triton(engine_checkpoint):
    model_dir, _, adapters = engine_checkpoint
    done = subprocess.run([sys.executable, "-c", BLOCKED_RUN, model_dir, adapters["r4"][0]], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["triton_available"] is False and result["triton_imported"] is False
    assert [len(tokens) for tokens in result["tokens"]] == [3, 3]


def test_triton_is_an_extra_that_test_includes():
    """Not a core dependency (about 1 GB on CPU); [test] and [gpu] bring it."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    extras = project["optional-dependencies"]
    assert any(dep.startswith("triton") for dep in extras["gpu"])
    assert any(dep.startswith("triton") for dep in extras["test"])
