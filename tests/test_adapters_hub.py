"""Hub resolution, offline: a cache laid out like huggingface_hub's resolves branch, tag and commit."""

import logging

import huggingface_hub
import pytest
import torch

from adapters import AdapterError, AdapterManager, AdapterNotFoundError, LoRARequest
from adapters.hub import adapter_file_patterns, resolve
from tests import factories

COMMIT_A, COMMIT_B = "a1" * 20, "b2" * 20


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """org/tenant: main and tag v1 at COMMIT_A (adapter seed 0), branch dev at COMMIT_B (seed 1)."""
    root = tmp_path_factory.mktemp("hub")
    base = factories.build_tiny_model("llama", seed=5)
    for seed in (0, 1):
        factories.save_lora(base, root / f"files{seed}", r=2, seed=seed, target_modules=["q_proj"])
    cache = root / "cache"
    factories.write_hub_cache(cache, "org/tenant", root / "files0", COMMIT_A, refs=("main", "v1"))
    factories.write_hub_cache(cache, "org/tenant", root / "files1", COMMIT_B, refs=("dev",))
    return dict(cache=cache, spec=factories.model_spec(base))


@pytest.mark.parametrize("revision,commit", [(None, COMMIT_A), ("main", COMMIT_A), ("v1", COMMIT_A),
                                             ("dev", COMMIT_B), (COMMIT_B, COMMIT_B), (COMMIT_A, COMMIT_A)])
def test_branch_tag_and_commit_resolve_offline(hub, revision, commit):
    local_dir = resolve("org/tenant", revision, local_files_only=True, cache_dir=hub["cache"])
    assert local_dir.endswith(f"snapshots/{commit}")


@pytest.mark.parametrize("path,revision", [("org/missing", None), ("org/tenant", "no-such-branch"),
                                           ("org/tenant", "c3" * 20), ("bad repo id!", None),
                                           ("/no/such/dir", None), ("./relative/dir", "main")])
def test_missing_repo_revision_or_dir_is_not_found(hub, path, revision):
    with pytest.raises(AdapterNotFoundError) as info:
        resolve(path, revision, local_files_only=True, cache_dir=hub["cache"])
    assert path in str(info.value) and (revision is None or revision in str(info.value))
    assert isinstance(info.value, AdapterError)


def test_local_dir_is_used_as_is_and_revision_ignored(tmp_path, caplog):
    (tmp_path / "adapter_config.json").write_text("{}")
    assert resolve(str(tmp_path)) == str(tmp_path)
    with caplog.at_level(logging.WARNING, logger="adapters.hub"):
        assert resolve(str(tmp_path), "v2") == str(tmp_path)
    assert any("ignored" in r.getMessage() for r in caplog.records)


def test_offline_env_and_allow_patterns_reach_snapshot_download(hub, monkeypatch):
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append(dict(repo_id=repo_id, **kwargs))
        if repo_id == "org/down":
            raise ConnectionError("network unreachable")
        return "/somewhere"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("org/x", "v3") == "/somewhere"
    assert calls[-1]["local_files_only"] is True and calls[-1]["revision"] == "v3"
    assert calls[-1]["allow_patterns"] == ["adapter_config.json", "adapter_model.safetensors"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    resolve("org/x", allow_patterns=adapter_file_patterns(allow_pickle=True))
    assert calls[-1]["local_files_only"] is False and "adapter_model.bin" in calls[-1]["allow_patterns"]
    resolve("org/x", local_files_only=True)  # the explicit option wins over the environment
    assert calls[-1]["local_files_only"] is True
    with pytest.raises(AdapterNotFoundError, match="network unreachable"):
        resolve("org/down")


def test_manager_loads_the_revision_asked_for(hub):
    manager = AdapterManager(hub["spec"], max_loras=2, max_lora_rank=4, max_cpu_loras=4, local_files_only=True,
                             resolver=lambda p, r, pats, off: resolve(p, r, pats, off, cache_dir=hub["cache"]))
    weights = {}
    for revision in ("v1", "dev", COMMIT_A):
        ref = manager.loras.add(LoRARequest(f"t-{revision}", "org/tenant", revision))
        slot = manager.loras.activate([ref])[0]
        weights[revision] = manager.lora_slots.weights(0, "qkv")[0][slot].clone()
    assert torch.equal(weights["v1"], weights[COMMIT_A]) and not torch.equal(weights["v1"], weights["dev"])
    with pytest.raises(AdapterNotFoundError, match="no-such-tag"):
        manager.loras.add(LoRARequest("t-bad", "org/tenant", "no-such-tag"))
    manager.close()


def test_manager_cache_dir_option(hub):
    manager = AdapterManager(hub["spec"], max_loras=1, max_lora_rank=4, max_cpu_loras=1, local_files_only=True,
                             cache_dir=hub["cache"])
    assert manager.loras.add(LoRARequest("t", "org/tenant", "dev")).revision == "dev"
    manager.close()

