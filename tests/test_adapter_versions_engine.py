"""Adapters that change every training step (issue 36), in Python: versioned reloads of a retrained
folder, updates from tensors in memory, the switch at a step boundary, and provenance on outputs.

Every served output is checked against PEFT's greedy tokens for the weights it should have run with,
and against the version it names (RequestOutput.lora_version).
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model_state_dict

from adapters import AdapterTooLargeError, InvalidAdapterError, LoRARequest, UnsupportedAdapterError
from adapters.tier import SupersededAdapterError
from lora_runner import SamplingParams
from tests import factories

from engine_support import ENGINE_DEFAULTS, assert_exact, make_engine, run_to_completion, step_until

PROMPT = list(range(5, 17))  # three full blocks of 4: a reused version would hit the prefix cache
MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
LORA = dict(r=4, lora_alpha=8, scale=0.15)


def policy_kit(engine_checkpoint, tmp_path_factory, name: str, seeds: tuple[int, ...]):
    """(model dir, base model, PEFT policies of one config with different weights, one per seed)."""
    path, hf, _ = engine_checkpoint
    root = tmp_path_factory.mktemp(name)
    policies = [factories.save_lora(hf, root / f"policy-{seed}", seed=seed, **LORA) for seed in seeds]
    return path, hf, policies


@pytest.fixture(scope="module")
def kit(engine_checkpoint, tmp_path_factory):
    return policy_kit(engine_checkpoint, tmp_path_factory, "versions", (21, 22, 23))


def peft_state(policy) -> dict[str, torch.Tensor]:
    """The policy's PEFT state dict (adapter_model.safetensors' key names), as a trainer hands it over."""
    return {key: tensor.detach().clone() for key, tensor in get_peft_model_state_dict(policy).items()}


def peft_config(policy):
    return policy.peft_config["default"]


def _generate(engine, request_id: str, lora_request, max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    return run_to_completion(engine, [(request_id, PROMPT, params, lora_request)])[request_id]


@pytest.mark.parametrize("how", ["serve_adapter", "add_lora"])
def test_load_inplace_of_a_retrained_folder_serves_the_new_weights_as_a_new_version(kit, tmp_path, greedy_oracle,
                                                                                       how):
    path, hf, _ = kit
    folder = tmp_path / "policy"
    engine = make_engine(path)
    request = LoRARequest("policy", str(folder))

    def reload():
        if how == "serve_adapter":
            return engine.serve_adapter(request, replace=True).version
        return engine.add_lora(request, load_inplace=True)

    old_policy = factories.save_lora(hf, folder, seed=31, **LORA)
    old = engine.serve_adapter(request).version if how == "serve_adapter" else engine.add_lora(request)
    for i in range(2):  # the second run hits the prefix cache: caching is on for this version
        first = _generate(engine, f"old-{i}", request)
        assert_exact(first, old_policy, PROMPT, greedy_oracle, MAX_TOKENS)
        assert first.lora_version == old
    assert first.num_cached_tokens > 0
    for step, seed in enumerate((32, 33)):  # retrain into the same folder, reload in place, twice
        new_policy = factories.save_lora(hf, folder, seed=seed, **LORA)
        new = reload()
        assert new.name == "policy" and new.version > old.version
        output = _generate(engine, f"new-{step}", request)
        assert_exact(output, new_policy, PROMPT, greedy_oracle, MAX_TOKENS)
        assert output.lora_version == new
        assert output.num_cached_tokens == 0, "a new version must never hit the old version's blocks"
        old = new


def test_a_folder_that_cannot_be_read_refuses_the_reload_and_the_old_version_serves(kit, tmp_path, greedy_oracle):
    path, hf, _ = kit
    folder = tmp_path / "policy"
    policy = factories.save_lora(hf, folder, seed=34, **LORA)
    engine = make_engine(path)
    request = LoRARequest("policy", str(folder))
    old = engine.serve_adapter(request).version
    (folder / "adapter_model.safetensors").write_bytes(b"truncated")
    with pytest.raises(InvalidAdapterError):
        engine.serve_adapter(request, replace=True)
    assert engine.served_adapter("policy").version == old
    factories.save_lora(hf, tmp_path / "unused", seed=34, **LORA)  # same weights again, elsewhere
    (folder / "adapter_model.safetensors").write_bytes((tmp_path / "unused" / "adapter_model.safetensors").read_bytes())
    output = _generate(engine, "after", request)
    assert_exact(output, policy, PROMPT, greedy_oracle, MAX_TOKENS)
    assert output.lora_version == old


def test_updates_from_memory_are_peft_exact_and_each_a_new_version(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)
    versions = []
    for step in range(5):  # a trainer pushing its policy after each step
        policy = policies[step % len(policies)]
        served = engine.update_lora("policy", peft_state(policy), peft_config(policy))
        versions.append(served.version.version)
        output = _generate(engine, f"s{step}", served.request)
        assert_exact(output, policy, PROMPT, greedy_oracle, MAX_TOKENS)
        assert output.lora_version == served.version
        assert output.num_cached_tokens == 0, (step, "a new version must never hit an older version's blocks")
    assert versions == sorted(set(versions))


def test_an_update_is_a_snapshot_the_trainer_cannot_change_afterwards(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)
    state = peft_state(policies[0])
    served = engine.update_lora("policy", state, peft_config(policies[0]).to_dict())  # a dict config works too
    for tensor in state.values():  # the trainer goes on changing its parameters in place
        tensor.mul_(-3.0)
    engine.adapters.manager.loras.remove("policy")  # the weights leave the CPU cache: a reload reads the snapshot
    output = _generate(engine, "after", served.request)
    assert_exact(output, policies[0], PROMPT, greedy_oracle, MAX_TOKENS)


def test_a_superseded_in_memory_request_is_refused_rather_than_undoing_the_update(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)
    first = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    second = engine.update_lora("policy", peft_state(policies[1]), peft_config(policies[1]))
    with pytest.raises(SupersededAdapterError, match="no longer the one served"):
        engine.add_request("stale", PROMPT, GREEDY, lora_request=first.request)
    assert engine.served_adapter("policy").version == second.version
    assert_exact(_generate(engine, "current", second.request), policies[1], PROMPT, greedy_oracle, MAX_TOKENS)


def _hostile_updates(policy) -> dict:
    """name -> (state dict, config, the error) of updates a trainer (or a tenant) must not get served."""
    state, config = peft_state(policy), peft_config(policy).to_dict()
    key = next(k for k in state if k.endswith("lora_A.weight"))
    wrong_shape = {**state, key: state[key].t().contiguous()}
    nan = {**state, key: state[key] * float("nan")}
    rank = ENGINE_DEFAULTS["max_lora_rank"] * 2
    over_rank = {k: (torch.zeros(rank, v.shape[1]) if k.endswith("lora_A.weight") else torch.zeros(v.shape[0], rank))
                 for k, v in state.items()}
    huge = {**state, key: torch.zeros(1).expand(1 << 30)}  # 4 GiB as counted, no memory behind it
    return {
        "wrong shape": (wrong_shape, config, InvalidAdapterError),
        "NaN": (nan, config, InvalidAdapterError),
        "over max_lora_rank": (over_rank, {**config, "r": rank}, AdapterTooLargeError),
        "over max_adapter_bytes": (huge, config, AdapterTooLargeError),
        "not a tensor": ({**state, key: state[key].tolist()}, config, InvalidAdapterError),
        "not a LoRA config": (state, {**config, "peft_type": "IA3"}, UnsupportedAdapterError),
    }


def test_hostile_updates_are_refused_and_the_current_version_keeps_serving(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path)
    current = engine.update_lora("policy", peft_state(policies[0]), peft_config(policies[0]))
    for what, (state, config, error) in _hostile_updates(policies[1]).items():
        with pytest.raises(error):
            engine.update_lora("policy", state, config)
        assert engine.served_adapter("policy").version == current.version, what
        output = _generate(engine, what, current.request)
        assert_exact(output, policies[0], PROMPT, greedy_oracle, MAX_TOKENS)
        assert output.lora_version == current.version, what


def stream_on_a_first_update(path, policy, max_tokens: int, after_tokens: int):
    """(engine, the first update of "policy", the stream's params, done so far): a greedy stream "old" of
    max_tokens started on that version, stepped until it has after_tokens tokens."""
    engine = make_engine(path)
    first = engine.update_lora("policy", peft_state(policy), peft_config(policy))
    long = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    engine.add_request("old", PROMPT, long, lora_request=first.request)
    done = step_until(engine, {}, lambda: any(r.num_output_tokens >= after_tokens for r in engine.scheduler.running))
    return engine, first, long, done


def test_a_stream_started_on_one_version_finishes_on_it_while_the_next_is_published(kit, greedy_oracle):
    path, _, policies = kit
    engine, v1, long, done = stream_on_a_first_update(path, policies[0], max_tokens=10, after_tokens=3)
    v2 = engine.update_lora("policy", peft_state(policies[1]), peft_config(policies[1]))  # mid-stream
    done = run_to_completion(engine, [("new", PROMPT, long, v2.request)], done=done)
    assert_exact(done["old"], policies[0], PROMPT, greedy_oracle, 10)
    assert_exact(done["new"], policies[1], PROMPT, greedy_oracle, 10)
    assert (done["old"].lora_version, done["new"].lora_version) == (v1.version, v2.version)
    assert engine.adapters.manager.loras._versions.get(v1.version) is None, "the old version outlived its last request"  # noqa: SLF001


def test_outputs_without_an_adapter_name_none(kit):
    path, _, _ = kit
    engine = make_engine(path)
    output = _generate(engine, "base", None)
    assert output.lora_version is None and output.prompt_adapter_version is None


def test_twenty_updates_while_other_tenants_stream_stay_exact(kit, greedy_oracle, engine_checkpoint):
    path, _, policies = kit
    _, _, loras = engine_checkpoint
    engine = make_engine(path)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    bystanders = [("tenant-lora", [3, 4, 5, 6], long, LoRARequest("r4", loras["r4"][0])),
                  ("tenant-base", [7, 8, 9], long)]
    done, updates = {}, []
    for request_id, prompt, params, *lora in bystanders:
        engine.add_request(request_id, prompt, params, lora_request=(lora or [None])[0])
    for step in range(20):
        policy = policies[step % len(policies)]
        served = engine.update_lora("policy", peft_state(policy), peft_config(policy))
        engine.add_request(f"u{step}", PROMPT, GREEDY, lora_request=served.request)
        updates.append((f"u{step}", policy, served.version))
        done.update({o.request_id: o for o in engine.step() if o.finished})  # one step per update
    done = run_to_completion(engine, done=done)
    assert all(output.error is None for output in done.values())
    assert_exact(done["tenant-lora"], loras["r4"][1], [3, 4, 5, 6], greedy_oracle, 24)
    assert_exact(done["tenant-base"], engine_checkpoint[1], [7, 8, 9], greedy_oracle, 24)
    for request_id, policy, version in updates:
        assert_exact(done[request_id], policy, PROMPT, greedy_oracle, MAX_TOKENS)
        assert done[request_id].lora_version == version


def test_llm_update_lora_and_generate_name_the_version(kit, greedy_oracle):
    from lora_runner import LLM

    path, _, policies = kit
    llm = LLM(path, **ENGINE_DEFAULTS)
    try:
        for policy in policies[:2]:
            served = llm.update_lora("policy", peft_state(policy), peft_config(policy))
            output = llm.generate([PROMPT], GREEDY, lora_request=served.request, use_tqdm=False)[0]
            assert_exact(output, policy, PROMPT, greedy_oracle, MAX_TOKENS)
            assert output.lora_version == served.version == llm.served_adapter("policy").version
    finally:
        llm.close()


@pytest.mark.slow
def test_updates_from_memory_reach_every_rank_at_tp2(kit, greedy_oracle):
    path, _, policies = kit
    engine = make_engine(path, tensor_parallel_size=2)  # every rank must sample the same tokens, or the engine dies
    try:
        files = engine.executor.shared.files_created
        for step, policy in enumerate(policies):
            served = engine.update_lora("policy", peft_state(policy), peft_config(policy))
            output = _generate(engine, f"tp{step}", served.request)
            assert_exact(output, policy, PROMPT, greedy_oracle, MAX_TOKENS)
            assert output.lora_version == served.version
        assert engine.executor.shared.files_created - files <= len(policies)  # one shared file per version at most
        assert engine.is_alive
    finally:
        engine.close()
