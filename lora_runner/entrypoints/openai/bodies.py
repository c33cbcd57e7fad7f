"""Generation request bodies, parsed off the event loop with their counts checked before validation.

FastAPI would parse and validate a route's body model on the event loop: a 1 MiB body of 262k
prompts costs seconds of pydantic work there (every union member tried on every item) while every
other tenant's stream waits. Here the JSON is decoded on the prompt pool, the number of prompts or
messages is checked on the decoded value (400, before any validation), and only then is the body
model validated, still on the pool. Fields the model does not know are dropped and reported
(ignored_fields), unless the server was started with --strict-request-fields.

JSON can say things no later stage can carry: an escaped lone UTF-16 surrogate decodes to a string
no tokenizer encodes, and nesting deeper than Python's recursion limit breaks the decoder with a
RecursionError (which the rest of the server reads as a stopped engine). Both are 400 here, before
any other stage sees the body; so is nesting deeper than MAX_BODY_DEPTH, which no request needs.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.ignored_fields import SCOPE_KEY, report, strip_unknown
from lora_runner.entrypoints.openai.protocol import ChatMessage
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tool_calls.definitions import MAX_TOOLS

logger = logging.getLogger(__name__)

MAX_BODY_DEPTH = 128  # nesting of objects and arrays in a body (a 32-deep schema is about 64 of them)


async def parse_body(state: ServerState, request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's body as `model` (400 for bad JSON, too many prompts or messages, invalid fields)."""
    raw = await request.body()
    body, ignored = await state.off_loop(parse_raw_body, state.config, raw, model)
    if ignored:
        logger.warning("%s: ignored request fields the server does not know: %s", request.url.path, report(ignored))
        request.scope[SCOPE_KEY] = ignored  # IgnoredFieldsHeaderMiddleware puts them in a header
    return body


def parse_raw_body(config: ServerConfig, raw: bytes, model: type[BaseModel]) -> tuple[BaseModel, list[str]]:
    """Decode, count, drop unknown fields (unless strict), validate (run it off the event loop).
    Returns the body and the names of the fields dropped."""
    try:
        decoded = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
        raise APIError(400, f"the body is not valid JSON: {exc}", "invalid_request") from None
    except RecursionError:
        raise APIError(400, f"the body nests objects or arrays more than {MAX_BODY_DEPTH} deep",
                       "invalid_request") from None
    check_decoded(decoded)
    ignored: list[str] = []
    if isinstance(decoded, dict):
        check_counts(config, decoded)
        if not config.strict_request_fields:
            decoded, ignored = strip_unknown(decoded, model, {"messages": ChatMessage} if "messages" in
                                             model.model_fields else {})
    try:
        return model.model_validate(decoded), ignored
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def check_counts(config: ServerConfig, decoded: dict) -> None:
    """400 for more prompts, messages or tools than the server takes in one request."""
    prompt, messages, tools = decoded.get("prompt"), decoded.get("messages"), decoded.get("tools")
    if isinstance(tools, list) and len(tools) > MAX_TOOLS:  # counted before pydantic validates each
        raise APIError(400, f"{len(tools)} tools, more than the limit of {MAX_TOOLS}", "too_many_tools")
    if isinstance(prompt, list) and len(prompt) > config.max_prompts_per_request \
            and not all(isinstance(p, int) for p in prompt):
        raise APIError(400, f"{len(prompt)} prompts in one request, more than the limit of "
                       f"{config.max_prompts_per_request} (--max-prompts-per-request)", "too_many_prompts")
    if isinstance(messages, list) and len(messages) > config.max_chat_messages:
        raise APIError(400, f"{len(messages)} messages, more than the limit of {config.max_chat_messages} "
                       "(--max-chat-messages)", "too_many_messages")


def check_decoded(decoded) -> None:
    """400 for nesting deeper than MAX_BODY_DEPTH or a string (value or key) that is no valid Unicode
    text (a lone surrogate). Walks the value iteratively: a deep value must not exhaust the stack."""
    stack = [(decoded, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_BODY_DEPTH:
                raise APIError(400, f"the body nests objects or arrays more than {MAX_BODY_DEPTH} deep",
                               "invalid_request")
            if isinstance(value, dict):
                for key in value:
                    _check_text(key)
            stack += [(item, depth + 1) for item in (value.values() if isinstance(value, dict) else value)]


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:  # only a surrogate can fail: JSON joins valid pairs into one character
        raise APIError(400, f"the body holds a lone UTF-16 surrogate (\\u{ord(text[exc.start]):04x}), which is "
                       "no valid text", "invalid_request") from None
