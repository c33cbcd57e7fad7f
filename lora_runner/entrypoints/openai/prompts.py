"""Prompts to token ids: completion prompts (text or ids, one or many) and chat messages."""

from __future__ import annotations

from lora_runner.engine.chat import chat_token_ids
from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.protocol import ChatMessage
from lora_runner.entrypoints.openai.state import ServerState


def completion_prompts(state: ServerState, prompt) -> list[list[int]]:
    """Token ids of each prompt: a string, a list of ids, a list of strings or of id lists."""
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts:
        raise APIError(400, "prompt must not be empty", "invalid_value")
    return [_encode(state, p) if isinstance(p, str) else list(p) for p in prompts]


def _encode(state: ServerState, text: str) -> list[int]:
    try:
        ids = state.engine.encode(text)
    except ValueError as exc:  # no tokenizer
        raise APIError(400, str(exc), "invalid_value") from exc
    if not ids:
        raise APIError(400, "prompt is empty", "invalid_value")
    return ids


def chat_prompt(state: ServerState, messages: list[ChatMessage]) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (400 when there is none)."""
    tokenizer = state.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", "no_chat_template")
    # name goes to the template (HF templates read message.name); a template that ignores it ignores it
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                    for m in messages]
    try:  # the same rendering and tokenization as LLM.chat
        return chat_token_ids(tokenizer, [conversation])[0]
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value") from exc
