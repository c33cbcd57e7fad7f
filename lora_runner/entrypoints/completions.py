"""POST /v1/completions and POST /v1/chat/completions."""

from __future__ import annotations

import time

from fastapi import Request

from lora_runner.entrypoints.formatting import ChatFormat, CompletionFormat
from lora_runner.entrypoints.generation import check_lengths, resolve_target, run_generation
from lora_runner.entrypoints.prompts import chat_prompt, completion_prompts
from lora_runner.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from lora_runner.entrypoints.sampling import check_supported, requested_logprobs, sampling_params
from lora_runner.entrypoints.state import ServerState
from lora_runner.entrypoints.tenants import Tenant

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


async def create_completion(state: ServerState, tenant: Tenant, body: CompletionRequest, request: Request):
    """A text completion of one or several prompts."""
    started = time.monotonic()
    check_supported(body, state.config.max_n)
    logprobs = requested_logprobs(body, state.max_logprobs)
    target = resolve_target(state, tenant, body.model, body.prompt_adapter)
    prompts = completion_prompts(state, body.prompt)
    max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
    check_lengths(state, prompts, max_tokens)
    params = sampling_params(body, max_tokens, logprobs)
    fmt = CompletionFormat(state.new_id("cmpl"), body.model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await run_generation(state, request, tenant, target, prompts, params, fmt, body.stream,
                                include_usage, started)


async def create_chat_completion(state: ServerState, tenant: Tenant, body: ChatCompletionRequest, request: Request):
    """A chat completion through the tokenizer's chat template."""
    started = time.monotonic()
    check_supported(body, state.config.max_n)
    logprobs = requested_logprobs(body, state.max_logprobs)
    target = resolve_target(state, tenant, body.model, body.prompt_adapter)
    prompt = chat_prompt(state, body.messages)
    max_tokens = body.max_completion_tokens or body.max_tokens or max(1, min(
        state.max_tokens_limit, state.max_model_len - len(prompt)))
    check_lengths(state, [prompt], max_tokens)
    params = sampling_params(body, max_tokens, logprobs)
    fmt = ChatFormat(state.new_id("chatcmpl"), body.model)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await run_generation(state, request, tenant, target, [prompt], params, fmt, body.stream,
                                include_usage, started)
