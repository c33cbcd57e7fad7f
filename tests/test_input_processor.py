"""InputProcessor (lora_runner.engine.input_processor) without a model: every bad argument of
add_request / abort_request raises ValueError naming it before a request is built; good ones
become one request, or n samples with their own ids and seeds."""

import pytest

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.core.request import Request
from lora_runner.engine.input_processor import InputProcessor, abort_ids
from lora_runner.sampling_params import SamplingParams

VOCAB, MAX_MODEL_LEN, MAX_LOGPROBS = 256, 16, 8
WORDS = {"hello": 9, "world": 10}


def encode(text):
    return [WORDS[word] for word in text.split()]


def no_tokenizer(text):
    raise ValueError("this model has no tokenizer: pass the prompt as a list of token ids")


def make_processor(encode=encode, prompts_enabled=True):
    return InputProcessor(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, max_logprobs=MAX_LOGPROBS,
                          encode=encode, prompts_enabled=prompts_enabled)


class Recorder:
    """A new_request that records its calls and builds plain Requests."""

    def __init__(self):
        self.calls = []

    def __call__(self, request_id, token_ids, params, prompt, lora_request, prompt_adapter_request, tenant,
                 cache_salt=None):
        self.calls.append((request_id, token_ids, params, prompt, lora_request, prompt_adapter_request, tenant))
        return Request(request_id, list(token_ids), params, arrival=len(self.calls), lora_request=lora_request,
                       prompt_adapter_request=prompt_adapter_request, tenant=tenant, cache_salt=cache_salt)


def samples(processor, request_id="r", prompt=(5, 6), params=None, lora_request=None, prompt_adapter_request=None,
            tenant=None, new_request=None):
    return processor.sample_requests(request_id, list(prompt) if isinstance(prompt, tuple) else prompt, params,
                                     lora_request, prompt_adapter_request, tenant, new_request or Recorder())


def _after(**changes):
    params = SamplingParams(max_tokens=3)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


BAD = {  # what -> (samples() kwargs, fragment of the ValueError)
    "request id of another type": (dict(request_id=5), "request_id must be a string"),
    "params of another type": (dict(params={"temperature": 0}), "params must be a SamplingParams"),
    "logprobs over max_logprobs": (dict(params=SamplingParams(logprobs=9)), r"max_logprobs \(8\)"),
    "logprobs set later to a bool": (dict(params=_after(logprobs=True)), "logprobs must be"),
    "stop id outside the vocabulary": (dict(params=SamplingParams(stop_token_ids=[VOCAB])), "stop_token_ids must lie"),
    "lora_request of another type": (dict(lora_request="r4"), "lora_request must be a LoRARequest"),
    "a PromptAdapterRequest as lora_request": (dict(lora_request=PromptAdapterRequest("p", "/p")),
                                               "lora_request must be a LoRARequest"),
    "tenant of another type": (dict(tenant=7), "tenant must be a string or None"),
    "a LoRARequest as prompt_adapter_request": (dict(prompt_adapter_request=LoRARequest("l", "/l")),
                                                "prompt_adapter_request must be a PromptAdapterRequest"),
    "empty prompt": (dict(prompt=[]), "prompt is empty"),
    "empty string prompt": (dict(prompt=""), "prompt is empty"),
    "prompt of another type": (dict(prompt=5.0), "prompt must be a string or a list of token ids"),
    "a list holding a float": (dict(prompt=[5, 6.0]), "prompt must be"),
    "prompt over max_model_len": (dict(prompt=list(range(3, 20))), "17 tokens, more than max_model_len=16"),
    "token id past the vocabulary": (dict(prompt=[5, VOCAB]), r"\[0, 256\)"),
    "negative token id": (dict(prompt=[-1, 5]), r"\[0, 256\)"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_argument_raises_before_any_request_is_built(what):
    kwargs, fragment = BAD[what]
    recorder = Recorder()
    with pytest.raises(ValueError, match=fragment):
        samples(make_processor(), new_request=recorder, **kwargs)
    assert recorder.calls == []


def test_string_prompts_need_a_tokenizer_and_prompt_adapters_need_slots():
    with pytest.raises(ValueError, match="pass the prompt as a list of token ids"):
        samples(make_processor(encode=no_tokenizer), prompt="hello world")
    with pytest.raises(ValueError, match="prompt adapters are disabled"):
        samples(make_processor(prompts_enabled=False), prompt_adapter_request=PromptAdapterRequest("p", "/p"))
    (request,) = samples(make_processor(), prompt="hello world hello")
    assert request.prompt_token_ids == [9, 10, 9]


def test_one_request_gets_a_private_validated_copy_of_its_params():
    recorder = Recorder()
    params = SamplingParams(temperature=0.5, max_tokens=4, stop_token_ids=[3], logprobs=2)
    lora = LoRARequest("r4", "/r4")
    (request,) = samples(make_processor(), "only", (5, 6, 7), params, lora_request=lora, tenant="acme",
                         new_request=recorder)
    request_id, token_ids, copied, prompt, lora_request, soft, tenant = recorder.calls[0]
    assert (request_id, token_ids, prompt, lora_request, soft, tenant) == ("only", [5, 6, 7], [5, 6, 7], lora, None,
                                                                           "acme")
    assert copied == params and copied is not params
    params.stop_token_ids.append(4)  # the caller changes its object later
    params.max_tokens = 100
    assert request.params.stop_token_ids == [3] and request.params.max_tokens == 4
    (default,) = samples(make_processor())
    assert default.params == SamplingParams()


def test_the_checks_run_on_a_private_copy(monkeypatch):
    caller = SamplingParams(max_tokens=3)
    validate = SamplingParams.validate

    def validate_then_race(self, **limits):
        validate(self, **limits)
        caller.max_tokens = 0  # another thread changes the caller's object right after the check

    monkeypatch.setattr(SamplingParams, "validate", validate_then_race)
    (request,) = samples(make_processor(), params=caller)
    assert request.params.max_tokens == 3  # what was checked is what runs


def test_n_samples_get_their_own_ids_and_seeds_and_share_the_prompt():
    recorder = Recorder()
    group = samples(make_processor(), "g", (5, 6), SamplingParams(n=3, seed=40, max_tokens=2), new_request=recorder)
    assert [r.request_id for r in group] == ["g[0]", "g[1]", "g[2]"]
    assert [r.params.seed for r in group] == [40, 41, 42] and all(r.params.n == 1 for r in group)
    assert all(call[1] == [5, 6] for call in recorder.calls)


def test_abort_ids():
    assert abort_ids("x") == ["x"]
    assert abort_ids(["a", "b"]) == ["a", "b"] and abort_ids(i for i in ("c",)) == ["c"]
    with pytest.raises(ValueError, match="request_id must be a string or an iterable of strings, got int"):
        abort_ids(123)
    with pytest.raises(ValueError, match="non-string id"):
        abort_ids(["a", 7])
