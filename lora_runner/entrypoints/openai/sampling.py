"""From an OpenAI request body to the engine's SamplingParams, refusing what cannot be honoured.

The engine has no best_of or suffix yet: a request that asks for one gets a 400 naming the field,
never a silently different result. Logprob counts of -1 (vLLM's: the whole vocabulary) become the
vocabulary size here, so the response's size bound (--max-logprob-entries) counts every entry.
"""

from __future__ import annotations

import json

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.generation_defaults import SamplingDefaults
from lora_runner.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from lora_runner.sampling_checks import WHOLE_VOCABULARY
from lora_runner.sampling_params import SamplingParams
from lora_runner.structured_outputs_params import StructuredOutputsParams


def _unsupported(field: str, what: str) -> APIError:
    return APIError(400, f"{field}: {what} is not supported by this server yet", "unsupported_parameter")


def check_supported(body: CompletionRequest | ChatCompletionRequest, max_n: int) -> None:
    """400 for every field set to something the engine cannot do."""
    if body.n > max_n:
        raise APIError(400, f"n must be <= {max_n}, got {body.n}", "invalid_value")
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", "invalid_value")
    if isinstance(body, CompletionRequest):
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 needs echo=true (the prompt scored, nothing generated)",
                           "invalid_value")
        if body.suffix:
            raise _unsupported("suffix", "a suffix")
        if body.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of > 1")


def requested_logprobs(body: CompletionRequest | ChatCompletionRequest, max_logprobs: int,
                       vocab_size: int) -> int | None:
    """How many top logprobs per token the request wants (None: no logprobs; -1: the vocabulary size);
    400 over the limit (max_logprobs: --max-logprobs, -1 for no cap)."""
    if isinstance(body, CompletionRequest):
        count, field = body.logprobs, "logprobs"
    elif body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "invalid_value")
    else:
        count, field = ((body.top_logprobs or 0) if body.logprobs else None), "top_logprobs"
    return None if count is None else _counted(field, count, max_logprobs, vocab_size)


def requested_prompt_logprobs(body: CompletionRequest | ChatCompletionRequest, max_logprobs: int,
                              vocab_size: int) -> int | None:
    """How many top logprobs per prompt position the request's ``prompt_logprobs`` (vLLM) wants (None:
    none; -1: the vocabulary size); 400 over the limit or with stream (as vLLM: the response carries
    them, no chunk does; ``prompt_logprobs=0`` with stream is accepted and returns nothing, as there)."""
    count = body.prompt_logprobs
    if count is None:
        return None
    if body.stream:
        if count != 0:
            raise APIError(400, "prompt_logprobs are not available with stream=true", "invalid_value")
        return None
    return _counted("prompt_logprobs", count, max_logprobs, vocab_size)


def _counted(field: str, count: int, max_logprobs: int, vocab_size: int) -> int:
    """`count` with -1 (the whole vocabulary) as `vocab_size`; 400 naming --max-logprobs over its cap
    (-1: none, as vLLM's) or over the vocabulary."""
    whole = count == WHOLE_VOCABULARY
    asked = vocab_size if whole else count
    what = f"{field}=-1 (the whole vocabulary, {vocab_size} tokens)" if whole else f"{field}={count}"
    if max_logprobs != WHOLE_VOCABULARY and asked > max_logprobs:
        raise APIError(400, f"{what} is more than this server's --max-logprobs ({max_logprobs}; -1 there lifts "
                       "the cap)", "invalid_value")
    if asked > vocab_size:
        raise APIError(400, f"{what} is more than the model's vocabulary ({vocab_size} tokens)", "invalid_value")
    return asked


def sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """The engine's SamplingParams (400 for values it rejects). Completions with echo and logprobs
    ask for the prompt's logprobs too, with as many alternatives; `prompt_logprobs` (the request's
    field, requested_prompt_logprobs) asks for them with its own count (the larger one is computed).
    defaults: the values of fields the body leaves out (--generation-config), before SamplingParams' own."""
    echo_logprobs = isinstance(body, CompletionRequest) and body.echo and logprobs is not None
    asked = [k for k in (logprobs if echo_logprobs else None, prompt_logprobs) if k is not None]

    def given(name: str, fallback):
        value = getattr(body, name)
        value = getattr(defaults, name) if value is None else value
        return fallback if value is None else value

    try:
        return SamplingParams(
            temperature=given("temperature", 1.0), top_p=given("top_p", 1.0), top_k=given("top_k", -1),
            min_p=given("min_p", 0.0),
            seed=body.seed, n=body.n, max_tokens=max_tokens, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, logprobs=logprobs, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=given("repetition_penalty", 1.0),
            stop=body.stop, include_stop_str_in_output=body.include_stop_str_in_output, min_tokens=body.min_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens, prompt_logprobs=max(asked) if asked else None,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            structured_outputs=structured_outputs(body), allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words, logit_bias=logit_bias(body.logit_bias))
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from exc


def structured_outputs(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The output constraint the body asks for: ``response_format`` (OpenAI: json_object, json_schema;
    text is none; vLLM's structural_tag), ``structured_outputs`` (vLLM) or vLLM's older ``guided_json`` /
    ``guided_regex`` / ``guided_choice`` / ``guided_grammar``; None when unconstrained. ValueError (a 400) when more
    than one is set or the constraint is malformed (StructuredOutputsParams' checks)."""
    asked = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(StructuredOutputsParams(json_object=True))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError('response_format of type "json_schema" needs a json_schema field')
        schema = fmt.json_schema.schema_
        asked.append(StructuredOutputsParams(json=schema) if schema is not None
                     else StructuredOutputsParams(json_object=True))
    elif fmt is not None and fmt.type == "structural_tag":  # vLLM's: the whole format, as its JSON text
        asked.append(StructuredOutputsParams(structural_tag=json.dumps(fmt.model_dump(exclude_none=True))))
    if body.structured_outputs is not None:
        so = body.structured_outputs
        asked.append(StructuredOutputsParams(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar,
                                             json_object=so.json_object, structural_tag=so.structural_tag,
                                             disable_any_whitespace=so.disable_any_whitespace, backend=so.backend))
    guided = dict(json=body.guided_json, regex=body.guided_regex, choice=body.guided_choice,
                  grammar=body.guided_grammar)
    guided = {kind: value for kind, value in guided.items() if value is not None}
    if guided:
        asked.append(StructuredOutputsParams(**guided))
    if len(asked) > 1:
        raise ValueError("set at most one of response_format (json_object / json_schema), structured_outputs "
                         "and the guided_* fields")
    return asked[0] if asked else None


def logit_bias(body_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as strings, as JSON keys are) as SamplingParams' dict token id ->
    bias; ValueError (a 400) for a key that is not a token id. The ids and values are SamplingParams'
    to check (the vocabulary, [-100, 100])."""
    if body_bias is None:
        return None
    bias = {}
    for key, value in body_bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ValueError(f"logit_bias keys must be token ids (decimal integers as strings), got {key!r:.40}")
        if int(key) in bias:  # "7" and "07"
            raise ValueError(f"logit_bias names token {int(key)} twice")
        bias[int(key)] = value
    return bias
