"""The SmolLM2 demo's tenants ship in the repo (examples/demo_adapters/<recipe key>): a first run
fetches and converts the model only; --rebuild retrains (and a retrained cache is preferred)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
MAX_SHIPPED_BYTES = 8 << 20  # what a clone pays for skipping the training


@pytest.fixture
def smollm2(monkeypatch, tmp_path):
    """examples/smollm2.py with the model fetch stubbed out (a base dir under tmp_path)."""
    monkeypatch.syspath_prepend(str(REPO / "examples"))
    import smollm2

    monkeypatch.setattr(smollm2, "real_model_dir", lambda root: tmp_path / "model")
    return smollm2


def test_the_shipped_tenants_are_the_recipes_in_fp16_and_small(smollm2):
    recipe = smollm2.RealRecipe()
    shipped = smollm2.SHIPPED_ADAPTERS / recipe.key
    assert json.loads((shipped / "DONE").read_text()) == json.loads(json.dumps(asdict(recipe)))
    for name in recipe.tenants:
        tensors = load_file(str(shipped / "adapters" / name / "adapter_model.safetensors"))
        assert tensors and {t.dtype for t in tensors.values()} == {torch.float16}
        config = json.loads((shipped / "adapters" / name / "adapter_config.json").read_text())
        assert config["peft_type"] == "LORA" and config["r"] == recipe.lora_rank
    for name in recipe.prompt_tenants:
        assert (shipped / "prompt_adapters" / name / "adapter_model.safetensors").is_file()
    assert sum(f.stat().st_size for f in smollm2.SHIPPED_ADAPTERS.rglob("*") if f.is_file()) < MAX_SHIPPED_BYTES


def test_a_first_run_uses_the_shipped_tenants_without_training(smollm2, tmp_path, monkeypatch):
    def no_training(*args):
        raise AssertionError("trained although the tenants ship with the repo")

    monkeypatch.setattr(smollm2, "_build", no_training)
    artifacts = smollm2.build_real_artifacts(tmp_path / "cache", progress=False)
    shipped = smollm2.SHIPPED_ADAPTERS / smollm2.RealRecipe().key
    assert artifacts.base_dir == tmp_path / "model"
    assert all(Path(p).parent.parent == shipped for p in [*artifacts.adapters.values(),
                                                           *artifacts.prompt_adapters.values()])


def test_rebuild_trains_into_the_cache_and_later_runs_use_it(smollm2, tmp_path, monkeypatch):
    trained = []

    def fake_build(base_dir, out, recipe, progress):
        trained.append(out)
        for name in recipe.tenants:
            (out / "adapters" / name).mkdir(parents=True)

    monkeypatch.setattr(smollm2, "_build", fake_build)
    cache = tmp_path / "cache"
    cache.mkdir()
    artifacts = smollm2.build_real_artifacts(cache, rebuild=True, progress=False)
    key = smollm2.RealRecipe().key
    assert len(trained) == 1 and all(Path(p).parent.parent == cache / key for p in artifacts.adapters.values())
    again = smollm2.build_real_artifacts(cache, progress=False)
    assert len(trained) == 1 and again.adapters == artifacts.adapters
