"""The adapters' byte bounds hold against every way around them (issues 34 and 36: nothing a tenant sends may
grow memory past an operator's bound, nor let one tenant's memory refuse another's updates).

- In-memory snapshots: each tenant gets a share (--max-tenant-share) of max_memory_adapter_bytes, charged to
  the adapter's owner, so tenant A filling its share leaves B's updates room; the operator keeps the whole bound.
- Prompt adapters: their CPU cache is bounded by bytes too (max_cpu_prompt_adapter_bytes), apart from the
  LoRAs' bound, and its default lets the count bind first.
- Pins: a replacement that would inherit a pin is checked against max_cpu_lora_bytes as a pin is.
- The engine's own process on CPU takes an explicit max_cpu_lora_bytes off the RAM its KV cache is sized from.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import psutil
import pytest
import torch
import yaml
from peft import get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes

from adapters import AdapterCapacityError, AdapterManager, CPUCacheBoundError, LoRARequest, PromptAdapterRequest
from adapters.lora import load_lora
from adapters.manager import prompt_cache_bytes
from adapters.memory_source import MemoryAdapterBoundError, MemoryAdapterShareError, MemorySnapshots
from engine_support import make_engine
from factories import save_prompt_adapter, save_tiny_model
from lora_runner import EngineConfig, LLMEngine
from lora_runner.model import load_model
from serve_support import serve_args, start_server

MiB = 2**20
RANK = 16


def _manager(spec, **overrides) -> AdapterManager:
    kwargs = dict(max_loras=3, max_lora_rank=RANK, max_cpu_loras=8, max_prompt_adapters=2,
                  max_prompt_adapter_tokens=8, local_files_only=True)
    return AdapterManager(spec, **{**kwargs, **overrides})


@pytest.fixture(scope="module")
def spec(engine_checkpoint):
    return load_model(engine_checkpoint[0])[1].spec()


def _peft_state(policy) -> tuple[dict[str, torch.Tensor], dict]:
    """(state dict, adapter_config dict) of a PeftModel, as a trainer hands them over."""
    state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(policy).items()}
    config = json.loads(json.dumps(policy.peft_config["default"].to_dict(),
                                   default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return state, config


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# ------------------------------------------------------------------ 1. a tenant's share of the snapshot bound
def test_the_ledger_charges_each_owner_and_holds_it_to_its_share():
    snapshots = MemorySnapshots(400)
    snapshots.reserve("a1", "memory:a1", 100, owner="A", share=0.5)
    snapshots.reserve("a2", "memory:a2", 100, owner="A", share=0.5)  # A holds its share, 200, exactly
    with pytest.raises(MemoryAdapterShareError, match="max_memory_adapter_bytes") as refused:
        snapshots.reserve("a3", "memory:a3", 1, owner="A", share=0.5)
    assert "share 200" in str(refused.value)
    snapshots.reserve("b1", "memory:b1", 150, owner="B", share=0.5)  # B's share is untouched by A's
    assert snapshots.owner_bytes("A") == 200 and snapshots.owner_bytes("B") == 150 and snapshots.nbytes == 350
    snapshots.reserve("op", "memory:op", 50)  # the operator: no share, the whole bound
    with pytest.raises(MemoryAdapterBoundError, match="max_memory_adapter_bytes"):
        snapshots.reserve("b2", "memory:b2", 1, owner="B", share=0.5)  # within B's share, over the bound
    snapshots.cancel("memory:a1")
    snapshots.reserve("a3", "memory:a3", 100, owner="A", share=0.5)  # A's freed bytes are A's again


def test_an_update_is_charged_to_the_adapters_owner_whoever_pushes_it(engine_checkpoint):
    path, _, adapters = engine_checkpoint
    state, config = _peft_state(adapters["r4"][1])
    one = _nbytes(state)
    engine = make_engine(path, max_memory_adapter_bytes=4 * one)
    ledger = engine.adapters.manager.memory_snapshots
    for name in ("a-1", "a-2"):
        engine.update_lora(name, state, config, owner="acme", tenant_share=0.5)
    assert ledger.owner_bytes("acme") == 2 * one
    with pytest.raises(MemoryAdapterShareError, match="max_memory_adapter_bytes"):
        engine.update_lora("a-1", state, config, tenant_share=0.5)  # no owner given: the served record's, acme
    assert engine.update_lora("b-1", state, config, owner="beta", tenant_share=0.5).owner == "beta"
    engine.update_lora("operator", state, config)  # the Python API's operator: the whole bound, all 4 used
    assert ledger.nbytes == 4 * one and ledger.owner_bytes(None) == one


KEYS = {
    "key-acme-000000": {"name": "acme", "adapters": ["a-1", "a-2", "a-3", "a-4"], "admin": True},
    "key-beta-000000": {"name": "beta", "adapters": ["b-1", "b-2"], "admin": True},
}
ACME, BETA = list(KEYS)


def test_one_tenant_filling_its_share_cannot_refuse_anothers_upload(engine_checkpoint, tmp_path):
    model_dir, _, adapters = engine_checkpoint
    state, config = _peft_state(adapters["r4"][1])
    one = _nbytes(state)
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    server, _ = start_server(serve_args(model_dir, {}, extra=[
        "--api-key", "byte-bounds-operator", "--tenant-keys", str(keys_file), "--allow-runtime-lora-updating",
        "--max-memory-adapter-bytes", str(4 * one), "--max-tenant-share", "0.5"]))

    def upload(name: str, key: str) -> httpx.Response:
        return httpx.post(server.base_url + f"/v1/lora_adapters/{name}/versions", timeout=60,
                          content=safetensors_bytes(state),
                          headers={"Authorization": f"Bearer {key}", "Content-Type": "application/octet-stream",
                                   "X-Adapter-Config": json.dumps(config)})

    try:
        for name in ("a-1", "a-2"):  # acme fills its share: 2 of the 4 snapshots the bound holds
            assert upload(name, ACME).status_code == 200
        for name in ("a-3", "a-4", "a-1"):  # a new name or an update of its own: over its share either way
            refused = upload(name, ACME)
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert "max_memory_adapter_bytes" in error["message"] and error["code"] == "tenant_share_exceeded"
        for name in ("b-1", "b-2"):  # beta's updates still fit: acme could not take the rest of the bound
            accepted = upload(name, BETA)
            assert accepted.status_code == 200, accepted.text
        listed = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {ACME}"}).json()
        assert {"a-1", "a-2"} <= {m["id"] for m in listed["data"]}  # acme's served versions keep serving
    finally:
        server.stop()


# ------------------------------------------------------------------ 2. prompt adapters bounded by bytes
def test_prompt_adapters_are_bounded_by_their_own_bytes(engine_checkpoint, spec, tmp_path):
    path, hf, adapters = engine_checkpoint
    for i, tokens in enumerate((4, 4, 8)):
        save_prompt_adapter(hf, tmp_path / f"p{i}", num_virtual_tokens=tokens, seed=i)
    one = 4 * spec.hidden_size * 4  # four virtual tokens in float32
    manager = _manager(spec, max_cpu_prompt_adapter_bytes=one * 3 // 2)  # one soft prompt of 4 tokens fits
    manager.loras.add(LoRARequest("r4", adapters["r4"][0]))
    tier = manager.prompts
    assert tier.max_cpu_bytes == one * 3 // 2
    tier.add(PromptAdapterRequest("p0", str(tmp_path / "p0")))
    tier.add(PromptAdapterRequest("p1", str(tmp_path / "p1")))  # the count (8) allows both; the bytes do not
    assert tier.list() == ["p1"] and tier.cpu_bytes == one and tier.counts()["cpu_evictions"] == 1
    with pytest.raises(CPUCacheBoundError, match="max_cpu_prompt_adapter_bytes"):  # 8 tokens: larger than the bound
        tier.add(PromptAdapterRequest("p2", str(tmp_path / "p2")))
    assert tier.list() == ["p1"] and manager.loras.list() == ["r4"]  # the LoRAs' cache is not the soft prompts'
    manager.close()
    # the default: max(max_cpu_loras, max_prompt_adapters) soft prompts of max_prompt_adapter_tokens, so the count
    # binds first
    manager = _manager(spec)
    assert manager.prompts.max_cpu_bytes == prompt_cache_bytes(spec, 8, 8, torch.float32) == 8 * 2 * one
    for i in range(3):
        manager.prompts.add(PromptAdapterRequest(f"p{i}", str(tmp_path / f"p{i}")))
    assert manager.prompts.list() == ["p0", "p1", "p2"]
    manager.close()


def test_the_engine_setting_reaches_the_prompt_cache(engine_checkpoint):
    engine = make_engine(engine_checkpoint[0], max_prompt_adapters=1, max_prompt_adapter_tokens=8,
                         max_cpu_prompt_adapter_bytes=12345)
    assert engine.adapters.manager.prompts.max_cpu_bytes == 12345
    with pytest.raises(ValueError, match="max_cpu_prompt_adapter_bytes"):
        EngineConfig("m", max_cpu_prompt_adapter_bytes=0)


# ------------------------------------------------------------------ 3. a replacement that inherits a pin
@pytest.fixture(scope="module")
def pinned_sizes(engine_checkpoint, spec):
    """(bytes of the kept pin r8-qv, of the small pinned r4, of the larger replacement r16-mlp)."""
    adapters = engine_checkpoint[2]
    sizes = tuple(load_lora(n, adapters[n][0], spec, max_lora_rank=RANK).nbytes for n in ("r8-qv", "r4", "r16-mlp"))
    assert sizes[1] < sizes[2], "the replacement must be the larger"
    return sizes


def _pinned_tier(engine_checkpoint, spec, pinned_sizes):
    """A LoRA tier whose bound lets r8-qv and r4 be pinned together, not r8-qv and r16-mlp ("x" pins r4)."""
    adapters = engine_checkpoint[2]
    keep, _, large = pinned_sizes
    manager = _manager(spec, max_cpu_lora_bytes=keep + large)
    tier = manager.loras
    tier.add(LoRARequest("keep", adapters["r8-qv"][0]))
    tier.add(LoRARequest("x", adapters["r4"][0]))
    tier.pin("keep")
    tier.pin("x")
    return manager, tier, tier.lookup("x")


def test_a_published_replacement_that_would_push_the_pins_past_the_bound_is_refused(engine_checkpoint, spec,
                                                                                    pinned_sizes):
    adapters = engine_checkpoint[2]
    manager, tier, old = _pinned_tier(engine_checkpoint, spec, pinned_sizes)
    staged = tier.stage(LoRARequest("x", adapters["r16-mlp"][0]), fresh=True)  # load_inplace / update_lora
    with pytest.raises(AdapterCapacityError, match="max_cpu_lora_bytes") as refused:
        tier.publish(None, True, staged)
    tier.release(staged)
    assert "cannot replace pinned LoRA 'x'" in str(refused.value)
    assert tier.lookup("x") == old and tier._get(old).pinned and tier.num_pinned() == 2  # noqa: SLF001
    assert tier.cpu_bytes == sum(pinned_sizes[:2])  # the refused version was dropped
    same_size = tier.stage(LoRARequest("x", adapters["r4"][0]), fresh=True)  # a new version that fits: pinned
    assert tier.publish(None, True, same_size)
    tier.release(same_size)
    assert tier.lookup("x") == same_size != old and tier._get(same_size).pinned  # noqa: SLF001
    manager.close()


def test_a_loaded_replacement_that_would_push_the_pins_past_the_bound_fails_and_the_pin_stays(engine_checkpoint,
                                                                                             spec, pinned_sizes):
    adapters = engine_checkpoint[2]
    manager, tier, old = _pinned_tier(engine_checkpoint, spec, pinned_sizes)
    with pytest.raises(AdapterCapacityError, match="max_cpu_lora_bytes"):  # a new path under the name: add()
        tier.add(LoRARequest("x", adapters["r16-mlp"][0]))
    assert tier.lookup("x") == old and tier._get(old).pinned and tier.num_pinned() == 2  # noqa: SLF001
    assert tier.cpu_bytes == sum(pinned_sizes[:2]) and tier.counts()["load_failures"] == 1
    tier.unpin("x")  # unpinned, the same replacement is only a cache entry: it loads
    assert tier.add(LoRARequest("x", adapters["r16-mlp"][0])) == tier.lookup("x") != old
    manager.close()


def test_a_dummy_that_would_inherit_a_pin_past_the_bound_is_refused(engine_checkpoint, spec, pinned_sizes):
    manager, tier, old = _pinned_tier(engine_checkpoint, spec, pinned_sizes)
    # rank 10 on every module: within the bound alone (check_fits), past it beside the kept pin
    with pytest.raises(AdapterCapacityError, match="max_cpu_lora_bytes"):
        tier.add_dummy("x", 10)
    assert tier.lookup("x") == old and tier._get(old).pinned  # noqa: SLF001
    manager.close()


# ------------------------------------------------------------------ 4. the engine's own process on CPU
def test_in_process_host_ram_takes_off_an_explicit_cpu_cache_bound_only(monkeypatch):
    from lora_runner.executor import startup

    monkeypatch.setattr(startup, "available_host_memory", lambda: 64 * MiB)
    assert startup.in_process_host_ram(EngineConfig("m", device="cpu")) == 64 * MiB  # the default is not
    assert startup.in_process_host_ram(EngineConfig("m", device="cpu", max_cpu_lora_bytes=24 * MiB)) == 40 * MiB
    assert startup.in_process_host_ram(EngineConfig("m", device="cpu", max_cpu_lora_bytes=96 * MiB)) == 0


def test_a_uni_cpu_engine_sizes_its_kv_cache_from_the_ram_left_by_an_explicit_cpu_cache_bound(tmp_path,
                                                                                              monkeypatch):
    path = tmp_path / "model"
    save_tiny_model(path, "llama", seed=0, max_position_embeddings=2**18)  # the RAM decides the KV cache
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(available=64 * MiB))
    engine = LLMEngine(str(path), device="cpu", max_cpu_lora_bytes=32 * MiB)
    assert engine.runner.kv_cache.nbytes == 8 * MiB  # a quarter of the 32 MiB left (16 MiB without the bound)
