"""Bad arguments (catalogue in test_reliability_catalogue.py): each raises ValueError, or
UnknownAdapterError for an unknown adapter name, naming what is wrong, while requests already in
the engine keep running and finish exactly as transformers/PEFT compute them.
"""

import pytest

from adapters import AdapterError, LoRARequest, UnknownAdapterError
from lora_runner import SamplingParams
from tests.test_reliability_catalogue import (  # noqa: F401 - hub_cache is a fixture
    GREEDY,
    assert_exact,
    assert_idle,
    good_requests,
    hub_cache,
    make_engine,
    step_until_done,
)

# (SamplingParams kwargs, the field the message must name)
BAD_SAMPLING = [(dict(temperature=-0.5), "temperature"), (dict(temperature=float("nan")), "temperature"),
                (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
                (dict(max_tokens=0), "max_tokens"), (dict(logprobs=-1), "logprobs"),
                (dict(stop_token_ids=[-3]), "stop_token_ids"), (dict(seed="7"), "seed")]


def test_bad_arguments_raise_and_others_stay_exact(engine_checkpoint, greedy_oracle, hub_cache):
    path, _, adapters = engine_checkpoint
    engine = make_engine(path, max_model_len=16)
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
    step_until_done(engine, done)
    for request_id, prompt, _, model in good:
        assert_exact(done[request_id], model, prompt, greedy_oracle)
    assert engine.has_unfinished_requests() is False
    engine.add_request("ok-r4", [5, 6, 7, 8], GREEDY, lora_request=good[0][2])  # a finished id is free again
    assert_exact(step_until_done(engine, {})["ok-r4"], good[0][3], [5, 6, 7, 8], greedy_oracle)
    assert_idle(engine)
