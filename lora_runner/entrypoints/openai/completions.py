"""POST /v1/completions and POST /v1/chat/completions.

The order is the cost order: checks that need no work (fields, model, counts) first, then the
tenant's seats are taken (prompts x n, so a tenant over its share is refused before any work), then
the prompts are tokenized off the event loop, then lengths are checked and the generation runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from fastapi import Request

from lora_runner.entrypoints.openai.echo import ChoiceExtras, check_logprob_entries, logprob_entries, response_bytes
from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.formatting import ChatFormat, CompletionFormat
from lora_runner.entrypoints.openai.generation import check_lengths, resolve_target, run_generation, virtual_tokens
from lora_runner.entrypoints.openai.generation_defaults import SamplingDefaults
from lora_runner.entrypoints.openai.prompts import chat_prompt, check_chat, completion_prompt_list, encode_prompts
from lora_runner.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from lora_runner.entrypoints.openai.sampling import (check_supported, requested_logprobs, requested_prompt_logprobs,
                                                     sampling_params)
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant
from lora_runner.entrypoints.openai.tool_calls.choice import ToolPlan, tool_plan
from lora_runner.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(state: ServerState, tenant: Tenant, body: CompletionRequest, request: Request):
    """A text completion of one or several prompts."""
    started = time.monotonic()
    logprobs, target = _checked(state, tenant, body)
    listed = completion_prompt_list(state, body.prompt)
    release = state.admit(tenant, len(listed) * body.n)
    try:
        prompts = await state.off_loop(encode_prompts, state, listed)
        max_tokens = body.max_tokens
        if max_tokens is None:  # --generation-config's max_new_tokens (fitted to the context), else OpenAI's 16
            room = state.max_model_len - max(map(len, prompts)) - virtual_tokens(state, target)
            default = state.sampling_defaults.max_tokens
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if default is None else max(1, min(default, room))
        # max_tokens=0 (echo only): one token is generated and not reported
        return await _generate(state, tenant, body, request, target, prompts, max(max_tokens, 1), logprobs, started,
                               CompletionFormat, "cmpl", release, lambda ids: _completion_extras(
                                   state, body, listed, ids, logprobs))
    except BaseException:
        release()
        raise


async def create_chat_completion(state: ServerState, tenant: Tenant, body: ChatCompletionRequest, request: Request):
    """A chat completion through the tokenizer's chat template."""
    started = time.monotonic()
    logprobs, target = _checked(state, tenant, body)
    options = check_chat(state, body)
    tools = tool_plan(body, state.config.tool_call_parser)  # 400 for bad tools before any work
    release = state.admit(tenant, body.n)
    try:
        prompt = await state.off_loop(chat_prompt, state, body.messages, tools.tools, options)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(
            state.max_tokens_limit, state.max_model_len - len(prompt) - virtual_tokens(state, target),
            state.sampling_defaults.max_tokens or state.max_tokens_limit))
        last = body.messages[-1]
        echo = [last.text()] if body.echo and last.role == "assistant" else None
        return await _generate(state, tenant, body, request, target, [prompt], max_tokens, logprobs, started,
                               ChatFormat, "chatcmpl", release,
                               lambda ids: ChoiceExtras(echo, return_token_ids=body.return_token_ids,
                                                        return_tokens_as_token_ids=body.return_tokens_as_token_ids),
                               tools)
    except BaseException:
        release()
        raise


def _checked(state: ServerState, tenant: Tenant, body: CompletionRequest | ChatCompletionRequest):
    """(logprobs, Target) after the checks both routes make first: unsupported fields and the
    logprobs limit (400), then the model and prompt adapter the tenant may use (404)."""
    check_supported(body, state.config.max_n)
    logprobs = requested_logprobs(body, state.max_logprobs, state.engine.vocab_size)
    requested_prompt_logprobs(body, state.max_logprobs, state.engine.vocab_size)  # its 400s before any work too
    return logprobs, resolve_target(state, tenant, body.model, body.prompt_adapter)


async def _generate(state: ServerState, tenant: Tenant, body: CompletionRequest | ChatCompletionRequest,
                    request: Request, target, prompts: list[list[int]], max_tokens: int, logprobs: int | None,
                    started: float, format_type, id_prefix: str, release, extras_of,
                    tools: ToolPlan | None = None):
    """Length checks (400), the engine's SamplingParams, then the generation in `format_type`'s shape
    (on the seats `release` gives back). truncate_prompt_tokens (vLLM) cuts each prompt first.
    extras_of(prompts as run) -> the choices' ChoiceExtras (echo, token ids). tools: a chat request's tool
    plan (its output constraint and tool-call parser)."""
    keep = body.truncate_prompt_tokens
    if keep is not None and keep != 0:  # 0 is refused by SamplingParams below
        prompts = [ids[-(state.max_model_len if keep == -1 else keep):] for ids in prompts]
    check_lengths(state, prompts, max_tokens, virtual_tokens(state, target))
    prompt_logprobs = requested_prompt_logprobs(body, state.max_logprobs, state.engine.vocab_size)
    tools = tools or ToolPlan()
    # a constraint's schema is validated, copied and serialized here: on the pool, as a big one takes seconds
    params = await state.off_loop(_sampling_params, body, max_tokens, logprobs, prompt_logprobs,
                                  state.sampling_defaults, tools)
    fmt = format_type(state.new_id(id_prefix), body.model)
    if state.config.enable_log_requests:  # lengths and parameters only: a prompt is the tenant's to read
        logger.info("request %s: model=%r prompt_tokens=%s params=%r", fmt.response_id, body.model,
                    [len(ids) for ids in prompts], params)
    extras = dataclasses.replace(extras_of(prompts), prompt_logprobs=prompt_logprobs)
    prompt_lens = [len(ids) for ids in prompts]
    check_logprob_entries(logprob_entries(prompt_lens, body.n, max_tokens, logprobs, extras,
                                          prompt_logprobs_per_choice=format_type is CompletionFormat),
                          state.config.max_logprob_entries)
    # what a whole response's building holds (a prompt's entries once for its n choices) counts in the tenant's
    # share until it was sent (a stream holds a chunk at a time, its unread output bounded apart)
    held = 0 if body.stream else response_bytes(prompt_lens, body.n, max_tokens, logprobs, extras)
    refund = state.reserve_response(tenant, held) if held else (lambda: None)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous_usage = include_usage and body.stream_options.continuous_usage_stats
    try:
        return await run_generation(state, request, tenant, target, prompts, params, fmt, body.stream,
                                    include_usage, started, release, cache_salt=body.cache_salt,
                                    continuous_usage=continuous_usage, extras=extras,
                                    new_parser=tools.parser_factory(body.stream), on_body_end=refund)
    except BaseException:
        refund()
        raise


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None, defaults: SamplingDefaults, tools: ToolPlan) -> SamplingParams:
    """The engine's SamplingParams (`defaults`: the server's sampling defaults, generation_defaults), with a
    forced tool_choice's constraint (400 beside another constraint)."""
    params = sampling_params(body, max_tokens, logprobs, prompt_logprobs, defaults)
    if tools.structured is not None:
        if params.structured_outputs is not None:
            raise APIError(400, "a forced tool_choice constrains the output itself: drop the other output "
                           "constraint (response_format / structured_outputs)", "invalid_tool_choice")
        params = dataclasses.replace(params, structured_outputs=tools.structured)
    if tools.keep_special_tokens:  # the tool-call parser reads a special token (ToolPlan)
        params = dataclasses.replace(params, skip_special_tokens=False)
    return params


def _completion_extras(state: ServerState, body: CompletionRequest, listed: list, prompts: list[list[int]],
                       logprobs: int | None) -> ChoiceExtras:
    """Completions' echo (each prompt's text: the one sent, or its token ids' text when it came as ids or
    was truncated) and return_token_ids."""
    if not body.echo:
        return ChoiceExtras(return_token_ids=body.return_token_ids,
                            return_tokens_as_token_ids=body.return_tokens_as_token_ids)
    texts = [given if isinstance(given, str) and body.truncate_prompt_tokens is None else state.prompt_text(ids)
             for given, ids in zip(listed, prompts)]
    return ChoiceExtras(texts, echo_logprobs=logprobs is not None, discard_generated=body.max_tokens == 0,
                        return_token_ids=body.return_token_ids,
                        return_tokens_as_token_ids=body.return_tokens_as_token_ids)
