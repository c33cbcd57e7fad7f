"""Prompts to token ids: completion prompts (text or ids, one or many) and chat messages.

Counts are checked first, on the event loop and before any work (400): the number of prompts, of
chat messages, and the length of each token-id prompt. Tokenizing and rendering chat templates is
work a tenant controls (a 1 MiB body), so the routes run it off the loop (ServerState.off_loop).
"""

from __future__ import annotations

import json

from lora_runner.engine.chat import chat_token_ids
from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
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


def check_chat(state: ServerState, body: ChatCompletionRequest) -> dict:
    """400 before any rendering: too many messages, a model without a chat template, or template options
    the server does not allow; else the options to render with (template_options)."""
    limit = state.config.max_chat_messages
    if len(body.messages) > limit:
        raise APIError(400, f"{len(body.messages)} messages, more than the limit of {limit} (--max-chat-messages)",
                       "too_many_messages")
    options = template_options(state, body)
    tokenizer = state.tokenizer
    if options["chat_template"] is None and (tokenizer is None or not getattr(tokenizer, "chat_template", None)):
        raise APIError(400, "this model has no chat template; use /v1/completions (or start the server with "
                       "--chat-template)", "no_chat_template")
    return options


# apply_chat_template's own arguments: a chat_template_kwargs entry may not replace them
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "tokenize", "return_dict", "return_tensors", "padding",
    "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask", "add_generation_prompt",
    "continue_final_message"})


def template_options(state: ServerState, body: ChatCompletionRequest) -> dict:
    """chat_token_ids' keyword arguments of a chat request, as vLLM reads its fields: the request's
    ``chat_template`` (or ``chat_template_kwargs["chat_template"]``) only when the server trusts request
    templates (--trust-request-chat-template; a template is code the server runs, and a tenant's can
    take CPU and memory without bound), else the server's --chat-template or the tokenizer's;
    ``chat_template_kwargs`` reach the template as variables; ``add_generation_prompt`` and
    ``continue_final_message`` as in LLM.chat. 400 for what cannot be honoured."""
    kwargs = dict(body.chat_template_kwargs or {})
    bad = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)} (use the request's own fields)",
                       "invalid_value")
    requested = kwargs.pop("chat_template", None)
    if body.chat_template is not None and requested is not None:
        raise APIError(400, "chat_template is given twice (the field and chat_template_kwargs)", "invalid_value")
    requested = body.chat_template if body.chat_template is not None else requested
    if requested is not None and not isinstance(requested, str):
        raise APIError(400, "chat_template must be a string (a Jinja template)", "invalid_value")
    if requested is not None and not state.config.trust_request_chat_template:
        raise APIError(400, "this server does not accept chat templates in requests (the operator may start it "
                       "with --trust-request-chat-template)", "chat_template_not_allowed")
    if body.add_generation_prompt and body.continue_final_message:
        raise APIError(400, "add_generation_prompt and continue_final_message cannot both be true",
                       "invalid_value")
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise APIError(400, "continue_final_message needs the last message to be the assistant's",
                       "invalid_value")
    return dict(chat_template=requested if requested is not None else state.config.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message, tenant_template_kwargs=kwargs or None)


def chat_prompt(state: ServerState, messages: list[ChatMessage], tools: list[dict] | None = None,
                options: dict | None = None) -> list[int]:
    """Token ids of the conversation through the chat template, with the request's tools
    (ToolPlan.tools) if any and its template options (check_chat's; run it off the event loop)."""
    conversation = [_template_message(m) for m in messages]
    try:  # the same rendering and tokenization as LLM.chat
        return chat_token_ids(state.tokenizer, [conversation], tools=tools, **(options or {}))[0]
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
