"""Bad arguments (catalogue in test_engine_bad_adapters.py): each raises ValueError, or
UnknownAdapterError for an unknown adapter name, naming what is wrong, while requests already in
the engine keep running and finish exactly as transformers/PEFT compute them.

Hostile SamplingParams: each is refused at add_request, changed fields
included, before touching engine state; a request running meanwhile keeps bit-identical output;
LLM.generate leaves nothing live after refusing.
"""

import pytest

from adapters import AdapterError, LoRARequest, PromptAdapterRequest, UnknownAdapterError
from lora_runner import LLM, SamplingParams
from tests import factories
from engine_support import assert_exact, assert_idle, make_engine, run_to_completion
from test_engine_bad_adapters import GREEDY, OFFLINE, good_requests, hub_cache  # noqa: F401 - hub_cache is a fixture

# (SamplingParams kwargs, the field the message must name)
BAD_SAMPLING = [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
                (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
                (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-2), "logprobs"),
                (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(seed="7"), "seed")]


def test_bad_arguments_raise_and_others_stay_exact(engine_checkpoint, greedy_oracle, hub_cache):
    path, _, adapters = engine_checkpoint
    engine = make_engine(path, **OFFLINE, max_model_len=16)
    good = good_requests(engine_checkpoint, "ok")
    for request_id, prompt, lora, _ in good:
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    done = {o.request_id: o for o in engine.step() if o.finished}
    bad_calls = {  # in order; the duplicate first, while "ok-r4" surely still runs
        "duplicate request id": (lambda: engine.add_request("ok-r4", [5], GREEDY), "'ok-r4' is already in use"),
        "empty prompt": (lambda: engine.add_request("e", [], GREEDY), "prompt is empty"),
        "empty string prompt": (lambda: engine.add_request("e", "", GREEDY), "prompt is empty"),
        "prompt over max_model_len": (lambda: engine.add_request("l", list(range(3, 20)), GREEDY),
                                      "17 tokens, more than max_model_len=16"),
        "token id outside the vocabulary": (lambda: engine.add_request("v", [5, 256], GREEDY), "vocabulary"),
        "prompt of another type": (lambda: engine.add_request("t", 5.0, GREEDY), "prompt must be"),
        "params of another type": (lambda: engine.add_request("p", [5], {"temperature": 0}), "SamplingParams"),
        "lora_request of another type": (lambda: engine.add_request("r", [5], GREEDY, lora_request="r4"),
                                         "LoRARequest"),
        "a PromptAdapterRequest as lora_request": (
            lambda: engine.add_request("r", [5], GREEDY, lora_request=PromptAdapterRequest("p", adapters["r4"][0])),
            "lora_request must be a LoRARequest"),
        "a LoRARequest as prompt_adapter_request": (
            lambda: engine.add_request("r", [5], GREEDY, prompt_adapter_request=LoRARequest("r4", adapters["r4"][0])),
            "prompt_adapter_request must be a PromptAdapterRequest"),
        "request id of another type": (lambda: engine.add_request(5, [5], GREEDY), "request_id must be a string"),
        "abort of an int id": (lambda: engine.abort_request(123), "request_id must be a string"),
        "abort of a list holding an int": (lambda: engine.abort_request(["ok-r4", 7]), "non-string id"),
        "adapter request without a name": (lambda: LoRARequest("", adapters["r4"][0]), "name must be"),
        "adapter request without a path": (lambda: LoRARequest("x", ""), "path must be"),
    }
    for what, (call, fragment) in bad_calls.items():
        with pytest.raises(ValueError, match=fragment):
            call()
        done.update({o.request_id: o for o in engine.step() if o.finished})
    for kwargs, field in BAD_SAMPLING:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)
    for method in (engine.remove_lora, engine.pin_lora, engine.unpin_lora):
        with pytest.raises(UnknownAdapterError, match="'no-such-tenant'") as info:
            method("no-such-tenant")
        assert isinstance(info.value, KeyError) and isinstance(info.value, AdapterError)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    run_to_completion(engine, done=done)
    for request_id, prompt, _, model in good:
        assert_exact(done[request_id], model, prompt, greedy_oracle)
    assert engine.has_unfinished_requests() is False
    engine.add_request("ok-r4", [5, 6, 7, 8], GREEDY, lora_request=good[0][2])  # a finished id is free again
    assert_exact(run_to_completion(engine)["ok-r4"], good[0][3], [5, 6, 7, 8], greedy_oracle)
    assert_idle(engine)


# ---------------------------------------------------------------- hostile SamplingParams
def _after(**changes):
    """Valid params whose fields are changed after construction, as a caller may do."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


def hostile_params():
    """what -> (params, fragment of the ValueError), for an engine with max_logprobs=8 on the 256-token model."""
    return {
        "logprobs over the vocabulary": (SamplingParams(logprobs=257), "logprobs=257 is over"),
        "logprobs=True set later": (_after(logprobs=True), "logprobs must be None or an integer"),
        "logprobs=10**6 set later": (_after(logprobs=10**6), "logprobs=1000000 is over"),
        "logprobs over max_logprobs": (SamplingParams(logprobs=9), r"over the engine's max_logprobs \(8\)"),
        "stop_token_ids=None set later": (_after(stop_token_ids=None), "stop_token_ids must be a list"),
        "5 million stop_token_ids": (_after(stop_token_ids=list(range(5_000_000))), "5000000 entries"),
        "stop id outside the vocabulary": (SamplingParams(stop_token_ids=[256]), "stop_token_ids must lie"),
        "temperature set to a string": (_after(temperature="hot"), "temperature must be"),
        "max_tokens set to True": (_after(max_tokens=True), "max_tokens must be"),
        "seed too large for a generator": (_after(seed=2**70), "seed must be"),
    }


def _serve_bystanders(engine, adapters, attacks=None):
    """Run three bystanders (base, a LoRA, seeded sampling) to the end; with `attacks`, try every
    hostile add_request between steps and change the bystanders' own params objects after adding
    them. Returns id -> (finish_reason, token_ids, logprobs)."""
    bystanders = {"by-base": ([12, 13], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1),
                              None),
                  "by-r4": ([5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=8),
                            LoRARequest("r4", adapters["r4"][0])),
                  "by-seeded": ([9, 10, 11], SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True,
                                                            logprobs=2), None)}
    engine.add_lora(bystanders["by-r4"][2])  # loaded before the first step: the same batches in every run
    for request_id, (prompt, params, lora) in bystanders.items():
        engine.add_request(request_id, prompt, params, lora_request=lora)
    if attacks is not None:
        for _, params, _ in bystanders.values():  # the engine holds its own copy
            params.max_tokens, params.logprobs, params.temperature = 1, 10**6, 5.0
            params.stop_token_ids.extend(range(256))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        for what, (params, fragment) in (attacks or {}).items():
            with pytest.raises(ValueError, match=fragment):
                engine.add_request(f"attack-{what}", [5, 6], params)
    return {i: (o.outputs[0].finish_reason, o.outputs[0].token_ids, o.outputs[0].logprobs) for i, o in done.items()}


def test_hostile_sampling_params_fail_at_add_request_and_leave_the_engine_untouched(engine_checkpoint, greedy_oracle):
    path, hf, adapters = engine_checkpoint
    reference = _serve_bystanders(make_engine(path, **OFFLINE, max_logprobs=8), adapters)
    engine = make_engine(path, **OFFLINE, max_logprobs=8)
    for what, (params, fragment) in hostile_params().items():  # on an idle engine
        with pytest.raises(ValueError, match=fragment):  # the 5M ids are refused unscanned: test_sampling_params
            engine.add_request("attack", [5, 6], params)
        assert not engine.has_unfinished_requests() and engine.step() == [], what
    assert_idle(engine)

    attacked = _serve_bystanders(engine, adapters, hostile_params())
    assert attacked == reference  # tokens and logprobs bit for bit, though the callers changed their params
    for request_id, prompt, model in (("by-base", [12, 13], hf), ("by-r4", [5, 6, 7, 8], adapters["r4"][1])):
        assert attacked[request_id][1] == greedy_oracle(model, prompt, 5)[0]
    assert_idle(engine)
    engine.add_request("attack", [5, 6, 7, 8], GREEDY, lora_request=LoRARequest("r4", adapters["r4"][0]))
    assert_exact(run_to_completion(engine)["attack"], adapters["r4"][1], [5, 6, 7, 8], greedy_oracle)
    assert_idle(engine)


def test_generate_refuses_bad_arguments_before_running_and_leaves_nothing_live(engine_checkpoint, greedy_oracle,
                                                                               tmp_path):
    path, hf, adapters = engine_checkpoint
    factories.save_prompt_adapter(hf, tmp_path / "soft", num_virtual_tokens=4)
    llm = LLM(path, device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_num_seqs=4, max_model_len=64,
              block_size=4, max_prompt_adapters=1, max_prompt_adapter_tokens=8)
    r4, soft = LoRARequest("r4", adapters["r4"][0]), PromptAdapterRequest("soft", str(tmp_path / "soft"))
    prompts = [[5, 6, 7, 8], [12, 13]]

    def generate(params=GREEDY, **kwargs):
        return lambda: llm.generate(prompts, params, use_tqdm=False, **kwargs)

    calls = {
        "a LoRARequest as prompt_adapter_request": (generate(prompt_adapter_request=r4),
                                                    "prompt_adapter_request must be a PromptAdapterRequest"),
        "a PromptAdapterRequest as lora_request": (generate(lora_request=soft), "lora_request must be a LoRARequest"),
        "a list holding the other kind": (generate(lora_request=[r4, soft]), "lora_request entries must be"),
        "one LoRA name, two paths": (generate(lora_request=[LoRARequest("t", adapters["r4"][0]),
                                                            LoRARequest("t", adapters["r16-patterns"][0])]),
                                     "'t' is given two sources"),
        "one LoRA name, two revisions": (generate(lora_request=[LoRARequest("t", "org/tenant", "v1"),
                                                                LoRARequest("t", "org/tenant", "v2")]),
                                         "'t' is given two sources"),
        "one soft-prompt name, two paths": (generate(prompt_adapter_request=[
            soft, PromptAdapterRequest("soft", str(tmp_path / "elsewhere"))]), "'soft' is given two sources"),
        "logprobs=10**6 for the second prompt": (generate([GREEDY, _after(logprobs=10**6)]), "logprobs=1000000"),
        "stop_token_ids=None for the second prompt": (generate([GREEDY, _after(stop_token_ids=None)]),
                                                      "stop_token_ids must be a list"),
    }
    for what, (call, fragment) in calls.items():
        with pytest.raises(ValueError, match=fragment):
            call()
        bm = llm.engine.block_manager
        assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks, what
        assert "t" not in llm.list_loras() and "soft" not in llm.list_prompt_adapters(), what  # nothing loaded
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1),
                           lora_request=[r4, None], use_tqdm=False)
    assert_exact(outputs[0], adapters["r4"][1], prompts[0], greedy_oracle)
    assert_exact(outputs[1], hf, prompts[1], greedy_oracle)
    llm.close()
