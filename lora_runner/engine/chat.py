"""Chat conversations and tokenizer outputs as prompt token ids.

Conversations are rendered with the tokenizer's chat template (or one given) and tokenized as
transformers' ``apply_chat_template(tokenize=True)`` does: the rendered text is tokenized without
adding special tokens, so a template that writes BOS itself gets exactly one. Tokenizer outputs
(a ``BatchEncoding`` or a dict with ``input_ids``, 1-D integer tensors) become lists of ids.

Message text (content, name, tool calls and tool_call_id) and the tool definitions are the
tenant's: special tokens come from the template only. A
special-token string inside a message ("<|im_start|>system", "</s>") is replaced by a placeholder
no tenant can guess before rendering, and tokenized as plain text (``split_special_tokens=True``)
where the placeholder lands; the template's text around it is tokenized as usual. Conversations
without such strings take transformers' own path, token for token.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import torch

Message = Mapping[str, Any]


def as_conversations(messages) -> tuple[list[list[Message]], bool]:
    """(conversations, batched): one conversation (a list of messages) or a list of them.

    A message is a mapping with a string ``role`` and a ``content`` that is a string or a list of
    content parts (mappings, as OpenAI and multimodal templates use); None content is allowed for
    an assistant message that carries ``tool_calls``. ValueError otherwise.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts, "
                         f"or a list of such lists (one per conversation); got {_describe(messages)}")
    batched = isinstance(messages[0], (list, tuple))
    conversations = list(messages) if batched else [messages]
    for i, conversation in enumerate(conversations):
        where = f"conversation {i}" if batched else "messages"
        if not isinstance(conversation, (list, tuple)) or not conversation:
            raise ValueError(f"{where} must be a non-empty list of messages, got {_describe(conversation)}")
        for j, message in enumerate(conversation):
            _check_message(message, f"{where}[{j}]")
    return [list(c) for c in conversations], batched


def _check_message(message, where: str) -> None:
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {_describe(message)}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"{where} needs a non-empty string 'role', got {role!r}")
    if "content" not in message:
        raise ValueError(f"{where} (role {role!r}) has no 'content'")
    content = message["content"]
    if content is None and message.get("tool_calls"):
        return
    if isinstance(content, str):
        return
    if isinstance(content, (list, tuple)) and all(isinstance(part, Mapping) for part in content):
        return
    raise ValueError(f"{where} (role {role!r}): 'content' must be a string or a list of content-part "
                     f"dicts, got {_describe(content)}")


def _describe(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def chat_token_ids(tokenizer, conversations: list[list[Message]], chat_template: str | None = None,
                   add_generation_prompt: bool = True, continue_final_message: bool = False,
                   tools: list | None = None, chat_template_kwargs: dict | None = None,
                   tenant_template_kwargs: dict | None = None) -> list[list[int]]:
    """Token ids of each conversation, exactly as transformers' apply_chat_template(tokenize=True).
    tenant_template_kwargs: template variables a tenant sent (the server's chat_template_kwargs), whose
    strings are the tenant's text like the messages': a special-token string there stays text.

    ValueError when there is no tokenizer, no template (neither the tokenizer's nor
    `chat_template`), the template rejects the messages, or a rendering is empty.
    """
    if tokenizer is None:
        raise ValueError("chat needs a tokenizer, but the model dir has none: pass token ids to generate()")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template: pass chat_template=... (a Jinja template "
                         "string), or use generate() with a prompt you formatted yourself")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    shield = _SpecialTokenShield(tokenizer)
    shielded = [[shield.message(m) for m in conversation] for conversation in conversations]
    shielded_tools = None if tools is None else [shield.value(tool) for tool in tools]
    variables = {**(chat_template_kwargs or {}), **shield.value(tenant_template_kwargs or {})}
    try:
        rendered = tokenizer.apply_chat_template(
            shielded, chat_template=chat_template, tools=shielded_tools, tokenize=not shield.pieces, return_dict=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **variables)
    except Exception as err:  # noqa: BLE001 - a template may raise anything (jinja's raise_exception)
        raise ValueError(f"the chat template could not render the messages: {err}") from err
    ids = [shield.token_ids(text) for text in rendered] if shield.pieces else rendered
    ids = [list(map(int, row)) for row in ids]
    empty = [i for i, row in enumerate(ids) if not row]
    if empty:
        raise ValueError(f"the chat template rendered conversation(s) {empty} as an empty prompt")
    return ids


class _SpecialTokenShield:
    """Keeps special-token strings in messages from becoming special tokens (module docstring).

    ``message(m)``: a copy of the message whose content, name, tool calls and tool_call_id hold placeholders
    instead of special-token strings (remembered in ``pieces``); ``value(v)``: the same for any JSON-like
    value (a tool definition: keys and strings); ``token_ids(rendered)``: the rendering's ids, each
    placeholder's string tokenized as plain text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        specials = {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
        specials |= {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                     if getattr(t, "special", False)}
        specials.discard("")
        # longest first, so "<|im_start|>" wins over a special "<|" it contains
        self._special = (re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
                         if specials else None)
        self._nonce = secrets.token_hex(8)  # a tenant cannot write a placeholder it cannot guess
        self._placeholder = re.compile(f"\ue000{self._nonce}:([0-9]+)\ue001")  # private-use marks
        self.pieces: list[str] = []

    def message(self, message: Message) -> Message:
        """The message with its content (string or text parts), name, tool calls and tool_call_id shielded."""
        if self._special is None:
            return message
        shielded = dict(message)
        for key in ("content", "name", "tool_call_id"):
            value = message.get(key)
            if isinstance(value, str):
                shielded[key] = self._text(value)
            elif key == "content" and isinstance(value, (list, tuple)):
                shielded[key] = [{**part, "text": self._text(part["text"])} if isinstance(part.get("text"), str)
                                 else part for part in value]
        if message.get("tool_calls"):
            shielded["tool_calls"] = self.value(message["tool_calls"])
        return shielded

    def value(self, value):
        """A copy of a JSON-like value (dicts, lists, strings, numbers) with its keys and strings shielded."""
        if self._special is None:
            return value
        if isinstance(value, str):
            return self._text(value)
        if isinstance(value, Mapping):
            return {self.value(key): self.value(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(item) for item in value]
        return value

    def _text(self, text: str) -> str:
        return self._special.sub(self._hide, text)

    def _hide(self, match: re.Match) -> str:
        self.pieces.append(match.group(0))
        return f"\ue000{self._nonce}:{len(self.pieces) - 1}\ue001"

    def token_ids(self, rendered: str) -> list[int]:
        """Ids of a rendering: the template's text as apply_chat_template tokenizes it, the hidden strings as text."""
        ids, start = [], 0
        for match in self._placeholder.finditer(rendered):
            ids += self.tokenizer.encode(rendered[start:match.start()], add_special_tokens=False)
            ids += self.tokenizer.encode(self.pieces[int(match.group(1))], add_special_tokens=False,
                                         split_special_tokens=True)
            start = match.end()
        return ids + self.tokenizer.encode(rendered[start:], add_special_tokens=False)


def tensor_token_ids(tensor: torch.Tensor) -> list[int]:
    """A 1-D integer tensor as a list of ids (ValueError for any other shape or dtype)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"a tensor prompt must hold integer token ids, got dtype {tensor.dtype}")
    if tensor.dim() != 1:
        raise ValueError(f"a tensor prompt must be 1-D (one prompt's token ids), got shape {tuple(tensor.shape)}: "
                         "pass a list of 1-D tensors, or the tokenizer's BatchEncoding with its attention_mask")
    return [int(t) for t in tensor.tolist()]


def encoding_token_ids(encoding: Mapping) -> list[list[int]]:
    """Prompts of a tokenizer output (BatchEncoding or dict): ``input_ids`` of one prompt or a batch,
    lists or tensors; rows of a padded batch keep the tokens its ``attention_mask`` marks."""
    if "input_ids" not in encoding:
        raise ValueError(f"a dict prompt must hold 'input_ids' (a tokenizer output); got keys {sorted(encoding)}")
    rows = _rows(encoding["input_ids"], "input_ids")
    mask = encoding.get("attention_mask")
    if mask is None:
        return rows
    masks = _rows(mask, "attention_mask")
    if [len(m) for m in masks] != [len(r) for r in rows]:
        raise ValueError("attention_mask does not have the shape of input_ids")
    return [[t for t, keep in zip(row, m) if keep] for row, m in zip(rows, masks)]


def _rows(value, name: str) -> list[list[int]]:
    """[L] or [B, L] ids (tensor or nested lists) as B lists."""
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex:
            raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
        if value.dim() not in (1, 2):
            raise ValueError(f"{name} must be 1-D or 2-D, got shape {tuple(value.shape)}")
        value = value.tolist()
    if isinstance(value, Sequence) and value and all(isinstance(t, int) for t in value):
        return [list(value)]
    if isinstance(value, Sequence) and value and all(
            isinstance(row, Sequence) and all(isinstance(t, int) for t in row) for row in value):
        return [list(row) for row in value]
    raise ValueError(f"{name} must be a list of ints, a list of such lists, or an integer tensor")
