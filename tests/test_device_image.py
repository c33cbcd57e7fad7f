"""The device machines' image, emulated here: a hard dependency it lacks fails CI, not the device run.

Each test runs a subprocess whose imports are limited (benchmarks/device/image.py) to the image's
package list (benchmarks/device/image-packages.txt) plus the wheels we carry there
(benchmarks/device/requirements-device.txt): there ``import lora_runner`` works, an engine serves an
unconstrained request (a constrained one fails alone, with a ValueError naming xgrammar), and every
gpu test collects, as many as without the limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "device"))
import image  # noqa: E402  (benchmarks/device is a script folder)

LIMIT = "import sys; sys.path.insert(0, 'benchmarks/device'); import image; image.limit_imports(); "

SERVE = """
import json, sys, tempfile
sys.path.insert(0, 'tests')
from factories import save_tiny_model
from lora_runner import LLMEngine, SamplingParams
from lora_runner.structured_outputs_params import StructuredOutputsParams
path = tempfile.mkdtemp()
save_tiny_model(path, 'llama', seed=0)
engine = LLMEngine(path, device='cpu', max_num_seqs=2, max_model_len=64, max_loras=1)
engine.add_request('plain', [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
try:
    engine.add_request('json', [5, 6], SamplingParams(max_tokens=3, structured_outputs=StructuredOutputsParams(
        json={'type': 'object'})))
    refused = None
except ValueError as exc:
    refused = f'{type(exc).__name__}: {exc}'
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = list(out.outputs[0].token_ids)
print(json.dumps(dict(done=done, refused=refused, xgrammar='xgrammar' in sys.modules)))
"""


def limited(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter whose imports are limited to the image's (run from the repo root)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-c", LIMIT + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_limit_refuses_what_the_image_lacks_and_allows_what_it_has():
    """The emulation itself: packages installed here but not on the image do not import; the image's
    and the carried wheel's do (xgrammar, fastapi, pydantic and gguf are all installed on this machine)."""
    names = ["xgrammar", "fastapi", "pydantic", "gguf", "torch", "transformers", "peft", "safetensors", "re2"]
    proc = limited(f"import importlib, importlib.util, json; print(json.dumps({{n: importlib.util.find_spec(n) is not "
                   f"None for n in {names!r}}}))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found == {name: name not in ("xgrammar", "fastapi", "pydantic", "gguf") for name in names}


def test_lora_runner_imports_and_serves_without_a_constraint_backend():
    proc = limited(SERVE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert len(result["done"]["plain"]) == 3  # served
    assert "json" not in result["done"] and not result["xgrammar"]
    assert result["refused"].startswith("StructuredOutputError") and "xgrammar" in result["refused"]


def _collected(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return sorted(line for line in proc.stdout.splitlines() if "::" in line)


@pytest.mark.slow  # collects every test file, then the gpu ones under the limit (~30-60 s each here)
def test_every_gpu_test_collects_on_the_image():
    """Every gpu test of the whole suite (collected without the limit) collects from the files the
    device runs (image.gpu_test_files), under the limit."""
    args = ["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    want = _collected(subprocess.run([sys.executable, "-m", "pytest", *args, "tests"], cwd=ROOT, capture_output=True,
                                     text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}))
    files = [str(path.relative_to(ROOT)) for path in image.gpu_test_files(ROOT / "tests")]
    got = _collected(limited(f"import pytest; sys.exit(pytest.main({args + files!r}))", timeout=600))
    assert len(want) > 50 and got == want


@pytest.mark.slow  # the device run's plan at toy sizes (~15-40 s here)
def test_the_device_run_dry_run_runs_every_part_under_the_limit(tmp_path):
    """benchmarks/device/run.py --dry-run, its imports limited as on the device: every part but the tests
    (collected by the test above) runs and reports; the JSON and the markdown table are written."""
    parts = "setup,model,kernels,splitk,moe,profile,graphs,prefix,quant,spec,batch_invariant"
    code = (f"import os, runpy; os.environ['OUT'] = {str(tmp_path)!r}; "
            f"sys.argv = ['run.py', '--dry-run', '--parts', {parts!r}]; "
            "runpy.run_path('benchmarks/device/run.py', run_name='__main__')")
    proc = limited(code, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = json.loads((tmp_path / "device_run.json").read_text())
    assert {name: part["status"] for name, part in results["parts"].items()} == dict.fromkeys(parts.split(","), "ok")
    assert results["copy_gbps"] > 0 and all(row["differing"] == 0 for row in results["splitk"])
    assert {(row["adapters"], "error" in row) for row in results["moe_kernels"]} == {(0, False), (8, False)}
    moe_rows = {(row.get("weights") == "fp8", row["adapters"]) for row in results["moe_kernels"]}
    assert moe_rows == {(False, 0), (False, 8), (True, 0)}  # the FP8 experts' row (bench_moe_kernels.FP8_ADAPTERS)
    assert all(row["repeat_identical"] and row["same_as_eager"] == 1 for row in results["graphs_vs_eager"])
    assert {row["weights"] for row in results["quant_decode"]} == {"bf16", "fp8", "w4a16"}
    assert results["prefix_cache"]["cold_ttft_ms"] > 0 and results["profile"]["decode"]
    spec = {(row["method"], row["adapters"]): row for row in results["spec_decode"]}
    draft_loras = ("draft_model k=3 + draft LoRAs", 2)  # per-request draft adapters, at the most adapters
    assert set(spec) == {(method, adapters) for method in ("none", "ngram k=3", "draft_model k=3")
                         for adapters in (0, 2)} | {draft_loras}
    for (method, _), row in spec.items():  # fp32: speculation keeps every greedy token; verify steps replay graphs
        assert row["tokens_per_s"] > 0
        if method != "none":
            assert row["same_as_no_spec"] == 1 and row["drafts"] > 0 and row["verify_replays"] > 0, row
        if method.startswith("draft_model"):  # the draft's forwards replay its graphs; its adapters only where named
            assert row["draft_replays"] > 0 and row["draft_slot_loads"] == 2 * (method.endswith("LoRAs")), row
    table = (tmp_path / "device_run.md").read_text()
    assert "### targets" in table and "### decode by weight format" in table and "### speculative decoding" in table


def test_a_constraint_without_its_backend_is_a_400_naming_it_and_plain_requests_go_on(tmp_path, monkeypatch):
    """Over HTTP, in this process, both backends made unimportable (None in sys.modules; "auto" falls back
    from llguidance to xgrammar): the constrained request is refused with 400 naming the package, and the
    server goes on serving."""
    openai = pytest.importorskip("openai")
    from serve_support import serve_args, start_server
    from structured_support import save_byte_checkpoint

    monkeypatch.setitem(sys.modules, "xgrammar", None)
    monkeypatch.setitem(sys.modules, "llguidance", None)
    model_dir, _ = save_byte_checkpoint(tmp_path)
    server, _ = start_server(serve_args(model_dir, {}))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="xgrammar"):
            client.completions.create(model="base", prompt="x", max_tokens=4,
                                      extra_body={"structured_outputs": {"regex": "[0-9]+"}})
        ok = client.completions.create(model="base", prompt="x", max_tokens=4, temperature=0.0)
        assert ok.choices[0].finish_reason == "length"
    finally:
        server.stop()
