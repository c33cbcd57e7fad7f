"""The snapshots of LoRAs handed over in memory are counted and bounded by max_memory_adapter_bytes.

An update (LLMEngine.update_lora, or an upload over HTTP) keeps a snapshot of the trainer's tensors
while its name is served from it or a request runs on its version. These tests check that the bytes
counted are the snapshots' real storages, that twenty updates of one name leave only the live
versions' snapshots counted and held (a stream started on an old version finishes exactly, then its
snapshot is freed), and that an update past the bound is refused naming the setting, before any
copy, while the current version keeps serving (in Python and over HTTP: a 4xx). Without a tenant share
(the Python API, one tenant) the bound is one for the engine; each tenant's share of it is tested in
test_adapter_byte_bounds.py.
"""

from __future__ import annotations

import gc
import json
import weakref

import httpx
import pytest
import torch
from peft import get_peft_model_state_dict
from safetensors.torch import save as safetensors_bytes

from adapters.cache_memory import held_bytes
from adapters.memory_source import MemoryAdapterBoundError, default_memory_adapter_bytes
from adapters.slot_memory import cpu_cache_bytes
from lora_runner import SamplingParams
from tests import factories

from engine_support import assert_exact, make_engine, run_to_completion, step_until
from serve_support import serve_args, start_server, token_ids
from test_adapter_versions_engine import (GREEDY, LORA, MAX_TOKENS, PROMPT, peft_config, peft_state, policy_kit,
                                          stream_on_a_first_update)

@pytest.fixture(scope="module")
def kit(engine_checkpoint, tmp_path_factory):
    return policy_kit(engine_checkpoint, tmp_path_factory, "memsnap", (61, 62, 63))


def _nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in state.values())


def _counted(engine) -> int:
    """What the engine counts (the /metrics gauge's source), checked against the ledger it reads."""
    counted = engine.stats.adapters.memory_adapter_bytes
    assert counted == engine.adapters.manager.memory_snapshots.nbytes
    return counted


def _storages(requests) -> int:
    """The real bytes the snapshots of ``requests`` hold together: every distinct storage once."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for request in requests for t in request.tensors.values()}.values())


def test_counted_bytes_are_the_snapshots_real_storages_even_for_views(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)
    assert _counted(engine) == 0
    state = peft_state(policies[0])
    # a trainer may hand over views of one flat buffer: the snapshot copies each, so it holds numel bytes each
    flat = torch.cat([t.flatten() for t in state.values()] + [torch.zeros(1000)])
    views, offset = {}, 0
    for key, tensor in state.items():
        views[key] = flat[offset:offset + tensor.numel()].view_as(tensor)
        offset += tensor.numel()
    served = engine.update_lora("policy", views, peft_config(policies[0]))
    assert _counted(engine) == _storages([served.request]) == held_bytes(served.request.tensors.values())
    assert _counted(engine) == _nbytes(state) < flat.untyped_storage().nbytes()
    assert_exact(run_to_completion(engine, [("a", PROMPT, GREEDY, served.request)])["a"], policies[0], PROMPT,
                 greedy_oracle, MAX_TOKENS)


def test_the_cached_weights_are_the_snapshot_itself_not_a_second_copy(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)  # float32 on CPU, as the trainer's tensors: nothing to convert
    served = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    tier = engine.adapters.manager.loras
    weights = tier._versions.get(served.version).weights  # noqa: SLF001 - the cached version's weights
    factors = [t for pair in weights.pairs() for t in (pair.a, pair.b, pair.column_scale)]
    snapshot = list(served.request.tensors.values())
    assert tier.cpu_bytes == weights.nbytes == held_bytes(snapshot) == held_bytes(snapshot + factors)
    assert_exact(run_to_completion(engine, [("a", PROMPT, GREEDY, served.request)])["a"], policies[0], PROMPT,
                 greedy_oracle, MAX_TOKENS)
    # in another dtype the weights are a conversion, so they are their own storage
    engine = make_engine(path, dtype="bfloat16")
    served = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    weights = engine.adapters.manager.loras._versions.get(served.version).weights  # noqa: SLF001
    snapshot = list(served.request.tensors.values())
    assert held_bytes(snapshot + [t for pair in weights.pairs() for t in (pair.a, pair.b)]) \
        == held_bytes(snapshot) + weights.nbytes


def test_default_bound_is_the_cpu_cache_bytes_and_at_least_four_adapters(kit):
    path, _, _ = kit
    engine = make_engine(path)
    manager = engine.adapters.manager
    cache = cpu_cache_bytes(manager.spec, 4, 16, manager.dtype)
    assert manager.loras.max_cpu_bytes == cache
    assert manager.memory_snapshots.max_bytes == default_memory_adapter_bytes(cache, manager.max_adapter_bytes) \
        == max(cache, 4 * manager.max_adapter_bytes)
    assert make_engine(path, max_memory_adapter_bytes=12345).adapters.manager.memory_snapshots.max_bytes == 12345


def test_twenty_updates_keep_only_the_live_versions_snapshots(kit, greedy_oracle):
    path, _, policies = kit
    engine, first, _, done = stream_on_a_first_update(path, policies[0], max_tokens=40, after_tokens=1)
    old_bytes = _counted(engine)
    assert old_bytes == _storages([first.request])
    freed = []  # weak references to a snapshot tensor of each replaced version
    served = first
    for step in range(20):
        if step:
            freed.append(weakref.ref(next(iter(served.request.tensors.values()))))
        policy = policies[step % len(policies)]
        served = engine.update_lora("policy", peft_state(policy), peft_config(policy))
        done.update({o.request_id: o for o in engine.step() if o.finished})
        # live: the version "old" runs on, and the served one
        assert _counted(engine) == _storages([first.request, served.request]), step
        assert _counted(engine) <= 2 * old_bytes
    assert "old" not in done, "the stream must outlive the updates"
    gc.collect()
    assert all(ref() is None for ref in freed), "a replaced version's snapshot is still held"
    assert first.request.tensors, "the snapshot a running request holds was released"
    done = run_to_completion(engine, [("new", PROMPT, GREEDY, served.request)], done=done)
    assert_exact(done["old"], policies[0], PROMPT, greedy_oracle, 40)
    assert_exact(done["new"], policies[19 % len(policies)], PROMPT, greedy_oracle, MAX_TOKENS)
    assert done["old"].lora_version == first.version
    assert not first.request.tensors, "the old version's snapshot outlived its last request"
    assert _counted(engine) == _storages([served.request]) == old_bytes


def test_an_update_over_the_bound_is_refused_naming_the_setting_and_the_current_version_serves(kit, greedy_oracle):
    path, _, policies = kit
    one = _nbytes(peft_state(policies[0]))
    engine = make_engine(path, max_memory_adapter_bytes=one * 5 // 2)  # two snapshots fit, three do not
    v1 = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    long = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    engine.add_request("old", PROMPT, long, lora_request=v1.request)
    done = step_until(engine, {}, lambda: any(r.num_output_tokens >= 1 for r in engine.scheduler.running))
    v2 = engine.update_lora("policy", peft_state(policies[1]), peft_config(policies[1]))  # v1 still runs: two live
    state = peft_state(policies[2])
    with pytest.raises(MemoryAdapterBoundError, match="max_memory_adapter_bytes"):
        engine.update_lora("policy", state, peft_config(policies[2]))
    with pytest.raises(MemoryAdapterBoundError, match="max_memory_adapter_bytes"):  # another name: one global bound
        engine.update_lora("other", state, peft_config(policies[2]))
    assert _counted(engine) == 2 * one
    assert engine.served_adapter("policy").version == v2.version and engine.served_adapter("other") is None
    done = run_to_completion(engine, [("current", PROMPT, GREEDY, v2.request)], done=done)
    assert_exact(done["current"], policies[1], PROMPT, greedy_oracle, MAX_TOKENS)
    assert_exact(done["old"], policies[0], PROMPT, greedy_oracle, 12)
    assert _counted(engine) == one  # v1's last request ended: its snapshot went, so the update fits now
    v3 = engine.update_lora("policy", state, peft_config(policies[2]))
    done = run_to_completion(engine, [("next", PROMPT, GREEDY, v3.request)])
    assert_exact(done["next"], policies[2], PROMPT, greedy_oracle, MAX_TOKENS)


def test_a_withdrawn_or_refused_update_holds_nothing(kit):
    path, _, policies = kit
    engine = make_engine(path)
    served = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    assert engine.update_lora("policy", peft_state(policies[1]), peft_config(policies[1]), claim=lambda: False) is None
    assert _counted(engine) == _storages([served.request])  # the update its caller gave up on is not kept
    bad = {**peft_state(policies[1]), "base_model.model.nowhere.lora_A.weight": torch.zeros(4, 4)}
    with pytest.raises(Exception):  # noqa: B017 - any AdapterError: only what stays counted matters here
        engine.update_lora("policy", bad, peft_config(policies[1]))
    assert _counted(engine) == _storages([served.request])
    engine.unserve_adapter("policy")
    assert _counted(engine) == 0 and not served.request.tensors


# ------------------------------------------------------------------ over HTTP
KEY = "memsnap-operator-key"


def test_an_upload_over_the_bound_is_a_4xx_naming_the_setting_and_the_current_version_serves(engine_checkpoint,
                                                                                                tmp_path):
    model_dir, hf, _ = engine_checkpoint
    policies = [factories.save_lora(hf, tmp_path / f"p{seed}", seed=seed, **LORA) for seed in (71, 72)]
    uploads = []
    for policy in policies:
        state = {k: v.detach().clone().contiguous() for k, v in get_peft_model_state_dict(policy).items()}
        config = json.loads(json.dumps(peft_config(policy).to_dict(), default=lambda v: sorted(v)
                                       if isinstance(v, set) else str(v)))
        uploads.append((state, config))
    one = _nbytes(uploads[0][0])
    server, state = start_server(serve_args(model_dir, {}, extra=[
        "--api-key", KEY, "--allow-runtime-lora-updating", "--max-memory-adapter-bytes", str(one * 3 // 2)]))
    headers = {"Authorization": f"Bearer {KEY}"}

    def upload(weights, config):
        return httpx.post(server.base_url + "/v1/lora_adapters/pushed/versions", timeout=60,
                          content=safetensors_bytes(weights),
                          headers={**headers, "Content-Type": "application/octet-stream",
                                   "X-Adapter-Config": json.dumps(config)})

    def complete():
        body = dict(model="pushed", prompt="the cat sat on the mat", max_tokens=MAX_TOKENS, temperature=0.0,
                    logprobs=0)
        response = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        data = response.json()
        return token_ids(state.tokenizer, data["choices"][0]["logprobs"]["tokens"]), data["adapter"]

    try:
        first = upload(*uploads[0])
        assert first.status_code == 200, first.text
        before = complete()
        refused = upload(*uploads[1])  # the served snapshot and this one would pass the bound
        assert 400 <= refused.status_code < 500, refused.text
        assert "max_memory_adapter_bytes" in refused.json()["error"]["message"]
        assert complete() == before and before[1]["version"] == first.json()["version"]
        metrics = httpx.get(server.base_url + "/metrics", headers=headers, timeout=60).text.splitlines()
        assert f"lora_runner_memory_adapter_bytes {float(one)}" in metrics
    finally:
        server.stop()
