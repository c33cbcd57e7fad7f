"""The one registry of served adapters: the tier's version table (adapters.versions.ServedAdapter),
staged loads that become visible only when published, and the engine seam's one namespace."""

import pytest

from adapters import AdapterManager, LoRARequest, PromptAdapterRequest, UnknownAdapterError
from adapters.versions import ServedAdapter
from lora_runner.engine.adapters import EngineAdapters
from tests import factories


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    base = factories.build_tiny_model("llama", seed=6)
    dirs = {}
    for seed, name in enumerate("abcd"):
        factories.save_lora(base, root / name, r=2, seed=seed)
        dirs[name] = str(root / name)
    factories.save_prompt_adapter(base, root / "p", num_virtual_tokens=2, seed=1)
    dirs["p"] = str(root / "p")
    return dict(spec=factories.model_spec(base), dirs=dirs)


@pytest.fixture
def manager(env):
    manager = AdapterManager(env["spec"], max_loras=2, max_lora_rank=8, max_cpu_loras=2, max_prompt_adapters=1,
                             max_prompt_adapter_tokens=4)
    yield manager
    manager.close()


def req(env, name, source):
    return LoRARequest(name, env["dirs"][source])


def serve(tier, request, replace=False, claim=None):
    ref = tier.stage(request)
    try:
        return tier.publish(ServedAdapter(request.name, request, owner="t1"), replace, ref, claim)
    finally:
        tier.release(ref)


def test_a_served_name_outlives_the_eviction_of_its_weights(env, manager):
    tier = manager.loras
    serve(tier, req(env, "s", "a"))
    first = tier.served("s")
    assert first.version == tier.lookup("s") and first.owner == "t1" and first.kind == "lora"
    for name in "bc":  # a CPU cache of two: s is evicted
        tier.add(req(env, name, name))
    assert "s" not in tier.list() and tier.lookup("s") is None
    evicted = tier.served("s")
    assert evicted.version is None and evicted.request == first.request and evicted.created == first.created
    ref = tier.acquire(evicted.request)  # a request for the served name reloads it
    tier.add(evicted.request)
    assert tier.served("s").version == ref != first.version
    tier.release(ref)


def test_a_staged_load_serves_nothing_until_published(env, manager):
    tier = manager.loras
    serve(tier, req(env, "t", "a"))
    old = tier.served("t")
    tier.pin("t")
    staged = tier.stage(req(env, "t", "c"))
    assert tier.lookup("t") == old.version and tier.served("t") == old  # the old one serves meanwhile
    tier.release(staged)  # given up unpublished: dropped, nothing changed
    assert tier.memory_stats()["num_cpu"] == 1 and tier.served("t") == old
    with pytest.raises(ValueError, match="already loaded"):
        serve(tier, req(env, "t", "c"))  # a taken name needs replace
    assert not serve(tier, req(env, "t", "c"), replace=True, claim=lambda: False)  # its caller gave up
    assert tier.served("t") == old and tier.memory_stats()["num_cpu"] == 1
    assert serve(tier, req(env, "t", "c"), replace=True)
    new = tier.served("t")
    assert new.request.path == env["dirs"]["c"] and new.version != old.version
    assert tier.num_pinned() == 1 and tier.memory_stats()["num_cpu"] == 1  # the pin moved, the old one dropped
    tier.withdraw("t")
    assert tier.served("t") is None and tier.lookup("t") is None and tier.num_pinned() == 0
    with pytest.raises(UnknownAdapterError):
        tier.withdraw("t")


def test_loras_and_soft_prompts_share_one_namespace(env, manager):
    seam = EngineAdapters(manager, max_model_len=64, prompts_enabled=True)
    seam.serve(req(env, "x", "a"))
    with pytest.raises(ValueError, match="already loaded"):
        seam.serve(PromptAdapterRequest("x", env["dirs"]["p"]))
    assert seam.serve(PromptAdapterRequest("y", env["dirs"]["p"]), load=False).version is None
    assert [(a.name, a.kind) for a in seam.served_all()] == [("x", "lora"), ("y", "prompt_adapter")]
    assert seam.serve(req(env, "z", "b"), claim=lambda: False) is None
    assert seam.served("z") is None and "z" not in seam.list("lora")
    assert seam.withdraw("y").kind == "prompt_adapter" and seam.served("y") is None
