"""Checks of what a caller hands to add_request / abort_request, and the n > 1 fan-out into samples.

Every check raises ValueError naming what is wrong before any engine state is touched; the
engine's limits (vocabulary, max_model_len, max_logprobs) are the only sizes needed.
"""

from __future__ import annotations

from collections.abc import Callable

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.core.request import Request
from lora_runner.engine.parallel_sampling import sample_ids
from lora_runner.sampling_checks import whole_vocabulary_counts
from lora_runner.sampling_params import SamplingParams

# new_request(sample id, prompt token ids, the sample's params, prompt, lora_request, prompt_adapter_request,
# tenant, cache_salt) -> Request: the engine's, which adds what only it knows (arrival order, a seeded generator)
NewRequest = Callable[..., Request]


class InputProcessor:
    """add_request's argument checks for one engine.

    Args:
        vocab_size: the model's vocabulary; prompt and stop token ids must lie in [0, vocab_size).
        max_model_len: the longest prompt accepted (soft-prompt placeholders are checked once the
            prompt adapter is loaded: lora_runner.engine.adapters).
        max_logprobs: the most logprobs a request may ask for.
        encode: text -> token ids (ValueError when the model has no tokenizer); called per prompt,
            so a tokenizer swapped on the engine is the one used.
        prompts_enabled: False when the engine has no prompt-adapter slots.
    """

    def __init__(self, *, vocab_size: int, max_model_len: int, max_logprobs: int,
                 encode: Callable[[str], list[int]], prompts_enabled: bool) -> None:
        self.vocab_size, self.max_model_len, self.max_logprobs = vocab_size, max_model_len, max_logprobs
        self.encode, self.prompts_enabled = encode, prompts_enabled

    def sample_requests(self, request_id: str, prompt: str | list[int], params: SamplingParams | None,
                        lora_request: LoRARequest | None, prompt_adapter_request: PromptAdapterRequest | None,
                        tenant: str | None, new_request: NewRequest, cache_salt: str | None = None) -> list[Request]:
        """Check every argument, then build the request's samples with `new_request`: one Request
        under `request_id`, or params.n of them with ids f"{request_id}[i]" and
        ``params.sample_params(i)`` (lora_runner.engine.parallel_sampling). ValueError naming a bad
        argument; `new_request` is not called then."""
        if not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        params = self.checked_params(params)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(lora_request).__name__}")
        if tenant is not None and not isinstance(tenant, str):
            raise ValueError(f"tenant must be a string or None, got {type(tenant).__name__}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        check_prompt_adapter_request(prompt_adapter_request, self.prompts_enabled)
        token_ids = self.prompt_token_ids(prompt, params.truncate_prompt_tokens)
        return [new_request(sample_id, token_ids, params.sample_params(i), prompt, lora_request,
                            prompt_adapter_request, tenant, cache_salt)
                for i, sample_id in enumerate(sample_ids(request_id, params.n))]

    def checked_params(self, params: SamplingParams | None) -> SamplingParams:
        """A private, validated copy of the request's params (ValueError naming a bad field), so a
        caller changing its object later does not affect the request; logprobs / prompt_logprobs of -1
        (the whole vocabulary) are the vocabulary size in it."""
        if params is None:
            return SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        params = params.clone()
        params.validate(max_logprobs=self.max_logprobs, vocab_size=self.vocab_size)
        whole_vocabulary_counts(params, self.vocab_size)
        return params

    def prompt_token_ids(self, prompt: str | list[int], truncate: int | None = None) -> list[int]:
        """The prompt's token ids: a string is encoded, then only the last `truncate` kept (-1:
        max_model_len; SamplingParams.truncate_prompt_tokens); ValueError for another type, an empty
        prompt, one over max_model_len, or ids outside the vocabulary."""
        if isinstance(prompt, str):
            token_ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            token_ids = list(prompt)
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if truncate is not None:
            token_ids = token_ids[-(self.max_model_len if truncate == -1 else truncate):]
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        if min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.vocab_size}) (the model's vocabulary)")
        return token_ids


def check_prompt_adapter_request(request: PromptAdapterRequest | None, prompts_enabled: bool) -> None:
    """ValueError unless `request` is None or a PromptAdapterRequest an engine with(out) prompt
    adapter slots (`prompts_enabled`) can serve."""
    if request is None:
        return
    if not isinstance(request, PromptAdapterRequest):
        raise ValueError(f"prompt_adapter_request must be a PromptAdapterRequest or None, got "
                         f"{type(request).__name__}")
    if not prompts_enabled:
        raise ValueError(f"prompt adapter {request.name!r}: prompt adapters are disabled; create the engine "
                         "with max_prompt_adapters > 0 and max_prompt_adapter_tokens > 0")


def abort_ids(request_id) -> list[str]:
    """abort_request's argument as a list of ids; ValueError unless it is a string or an iterable of strings."""
    if isinstance(request_id, str):
        return [request_id]
    if not hasattr(request_id, "__iter__"):
        raise ValueError(f"request_id must be a string or an iterable of strings, got {type(request_id).__name__}")
    ids = list(request_id)
    if not all(isinstance(i, str) for i in ids):
        raise ValueError("request_id must be a string or an iterable of strings, got a non-string id")
    return ids
