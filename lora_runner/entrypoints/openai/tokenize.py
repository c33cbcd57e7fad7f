"""vLLM's /tokenize, /detokenize and /tokenizer_info: the ids the server would generate from, the text of
ids, and the tokenizer's special tokens and chat template (lm-eval's remote tokenizer reads all three, so
``local-completions`` needs no ``tokenizer=`` argument against this server).

A chat body is rendered exactly as /v1/chat/completions renders it (prompts.chat_prompt, with its
checks: message count, template trust, tools), so a client can count a conversation's tokens before
sending it. ``model`` (optional, as vLLM) must name a model the caller may use (404 otherwise, like
the generation routes): every adapter shares the base model's tokenizer.
"""

from __future__ import annotations

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.generation import resolve_target
from lora_runner.entrypoints.openai.prompts import chat_prompt, check_chat
from lora_runner.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from lora_runner.entrypoints.openai.state import ServerState
from lora_runner.entrypoints.openai.tenants import Tenant
from lora_runner.entrypoints.openai.tool_calls.definitions import checked_tools

# the fields a chat body of /tokenize shares with /v1/chat/completions
_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template",
                "chat_template_kwargs")


def _tokenizer(state: ServerState, tenant: Tenant, model: str | None):
    if model is not None:
        resolve_target(state, tenant, model, None)  # 404 for a model the tenant may not use
    tokenizer = state.tokenizer
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer", "invalid_value")
    return tokenizer


async def tokenize(state: ServerState, tenant: Tenant, body: TokenizeRequest) -> dict:
    """vLLM's TokenizeResponse: count, max_model_len, tokens (and token_strs when asked)."""
    tokenizer = _tokenizer(state, tenant, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "invalid_value")
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await state.off_loop(lambda: tokenizer.encode(body.prompt, add_special_tokens=add_special))
    else:
        if body.add_special_tokens:  # the template writes a chat prompt's special tokens (vLLM's default)
            raise APIError(400, "add_special_tokens=true is not supported with messages", "invalid_value")
        chat = ChatCompletionRequest.model_validate({"model": body.model or state.base_name,
                                                     **{name: getattr(body, name) for name in _CHAT_FIELDS}})
        options = check_chat(state, chat)
        tools = checked_tools(body.tools) if body.tools else None
        ids = await state.off_loop(chat_prompt, state, chat.messages, tools, options)
    response = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:
        response["token_strs"] = await state.off_loop(tokenizer.convert_ids_to_tokens, ids)
    return response


async def detokenize(state: ServerState, tenant: Tenant, body: DetokenizeRequest) -> dict:
    """vLLM's DetokenizeResponse: the ids' text (special tokens included); 400 for an id outside the vocabulary."""
    tokenizer = _tokenizer(state, tenant, body.model)
    vocab_size = len(tokenizer)
    bad = next((token for token in body.tokens if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "invalid_value")
    return {"prompt": await state.off_loop(tokenizer.decode, body.tokens)}


async def tokenizer_info(state: ServerState, tenant: Tenant) -> dict:
    """vLLM's TokenizerInfoResponse, as lm-eval's remote tokenizer reads it: tokenizer_class, the special
    tokens, model_max_length (the server's max_model_len) and the chat template chat requests render with
    (--chat-template, else the tokenizer's). vLLM's name_or_path and other init arguments are left out:
    no response shows a server path."""
    tokenizer = _tokenizer(state, tenant, None)
    info = {"tokenizer_class": type(tokenizer).__name__, "model_max_length": state.max_model_len}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        info[name] = getattr(tokenizer, name, None)
    template = state.config.chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info
