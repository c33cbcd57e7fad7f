"""Request fields the server does not know are ignored, as vLLM does, and said so: in the log and in
the response's ``X-Ignored-Fields`` header (clients written for vLLM or OpenAI send fields that this
server has no use for). ``--strict-request-fields`` turns them back into a 400.

What is reported is bounded: a body (already at most --max-body-bytes) may hold thousands of unknown
names, and the header and the log line show the first few, each cut short.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel

logger = logging.getLogger(__name__)

HEADER = "x-ignored-fields"
SCOPE_KEY = "lora_runner.ignored_fields"  # where parse_body leaves the names for the middleware
MAX_REPORTED = 16
MAX_NAME_CHARS = 64


def _known(model: type[BaseModel]) -> set[str]:
    names = set()
    for name, info in model.model_fields.items():
        names.add(name)
        if info.alias:
            names.add(info.alias)
    return names


def strip_unknown(decoded: dict, model: type[BaseModel], nested: dict[str, type[BaseModel]]) -> tuple[dict, list[str]]:
    """(`decoded` without the fields `model` does not know, their names). nested: list fields whose
    items are objects of another model (chat messages), stripped the same way ("messages[0].foo")."""
    known = _known(model)
    ignored = [name for name in decoded if name not in known]
    kept = {name: value for name, value in decoded.items() if name in known}
    for field, item_model in nested.items():
        items = kept.get(field)
        if not isinstance(items, list):
            continue
        item_known = _known(item_model)
        cleaned = []
        for index, item in enumerate(items):
            if isinstance(item, dict):
                ignored += [f"{field}[{index}].{name}" for name in item if name not in item_known]
                item = {name: value for name, value in item.items() if name in item_known}
            cleaned.append(item)
        kept[field] = cleaned
    return kept, ignored


def report(names: list[str]) -> str:
    """The header value (and log text) for the ignored `names`: the first MAX_REPORTED, cut short."""
    shown = [name if len(name) <= MAX_NAME_CHARS else name[:MAX_NAME_CHARS] + "..." for name in names[:MAX_REPORTED]]
    more = f", and {len(names) - MAX_REPORTED} more" if len(names) > MAX_REPORTED else ""
    # a header value must be latin-1 without control characters: anything else becomes "?"
    return "".join(c if " " <= c <= "~" else "?" for c in ", ".join(shown) + more)


class IgnoredFieldsHeaderMiddleware:
    """Adds ``X-Ignored-Fields`` to a response whose request body had fields the server ignored."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message) -> None:
            names = scope.get(SCOPE_KEY)
            if message["type"] == "http.response.start" and names:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (HEADER.encode(), report(names).encode("latin-1"))]}
            await send(message)

        await self.app(scope, receive, send_with_header)
