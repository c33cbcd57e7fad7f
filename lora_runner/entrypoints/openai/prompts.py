"""Prompts to token ids: completion prompts (text or ids, one or many) and chat messages.

Counts are checked first, on the event loop and before any work (400): the number of prompts, of
chat messages, and the length of each token-id prompt. Tokenizing and rendering chat templates is
work a tenant controls (a 1 MiB body), so the routes run it off the loop (ServerState.off_loop).
"""

from __future__ import annotations

import json

from lora_runner.engine.chat import chat_token_ids
from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.protocol import ChatMessage
from lora_runner.entrypoints.openai.state import ServerState


def completion_prompt_list(state: ServerState, prompt) -> list[str | list[int]]:
    """Each prompt of a completion request (a string, a list of ids, a list of strings or of id
    lists), counted and length-checked before any tokenization (400)."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", "invalid_value")
    limit = state.config.max_prompts_per_request
    if len(prompts) > limit:
        raise APIError(400, f"{len(prompts)} prompts in one request, more than the limit of {limit} "
                       "(--max-prompts-per-request)", "too_many_prompts")
    for ids in prompts:
        if not isinstance(ids, str) and len(ids) > state.max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(ids)} tokens, more than the limit of "
                           f"{state.max_prompt_tokens}", "prompt_too_long")
    return prompts


def encode_prompts(state: ServerState, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized: run it off the event loop)."""
    return [_encode(state, p) if isinstance(p, str) else list(p) for p in prompts]


def _encode(state: ServerState, text: str) -> list[int]:
    try:
        ids = state.engine.encode(text)
    except ValueError as exc:  # no tokenizer
        raise APIError(400, str(exc), "invalid_value") from exc
    if not ids:
        raise APIError(400, "prompt is empty", "invalid_value")
    return ids


def check_chat(state: ServerState, messages: list[ChatMessage]) -> None:
    """400 before any rendering: too many messages, or a model without a chat template."""
    limit = state.config.max_chat_messages
    if len(messages) > limit:
        raise APIError(400, f"{len(messages)} messages, more than the limit of {limit} (--max-chat-messages)",
                       "too_many_messages")
    tokenizer = state.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "no_chat_template")


def chat_prompt(state: ServerState, messages: list[ChatMessage], tools: list[dict] | None = None) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template, with the request's tools
    (ToolPlan.tools) if any (run it off the event loop, after check_chat)."""
    conversation = [_template_message(m) for m in messages]
    try:  # the same rendering and tokenization as LLM.chat
        return chat_token_ids(state.tokenizer, [conversation], tools=tools)[0]
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from exc


def _template_message(message: ChatMessage) -> dict:
    """A message as HF chat templates read it: name and tool_call_id when set (a template that ignores
    them ignores them), and tool calls whose arguments are objects (templates write them with tojson,
    and transformers documents them as dicts, as vLLM passes them) where the JSON string holds one."""
    rendered = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [{"id": call.id, "type": call.type, "function": {
            "name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    return rendered


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text  # not JSON: the template gets the string as sent
    return value if isinstance(value, dict) else text
