"""vLLM's ``mistral`` tool-call parser (``--tool-call-parser mistral``): calls after Mistral's
``[TOOL_CALLS]`` control token, in either of the two forms Mistral's tokenizers write:

- before tokenizer v11 (Mistral-7B-Instruct-v0.3 and older): one JSON array of calls,
  ``[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, ...]`` (keys in any order);
- v11 and later (Mistral-Small-3.1+, Devstral, Ministral): one token per call,
  ``[TOOL_CALLS]add{"a": 1}[TOOL_CALLS]multiply{"a": 3}`` (``[ARGS]`` between name and arguments, as v13
  writes it, is read too).

Text before the first ``[TOOL_CALLS]`` streams as content at once (the whitespace right before the token
is dropped when calls follow); from the token on the output is held until it ends, then becomes its calls,
each sent whole, and any text after the last call is content (as vLLM's stream gives it). As every parser
here: only offered functions become calls, and output that is not well-formed calls (an unknown name, a
repeated key, arguments that are no object, a call cut short) is shown as the content it was, where vLLM
would send a call with partial arguments.

``[TOOL_CALLS]`` is a special token, which decoding drops by default: a request this parser reads is
decoded with ``skip_special_tokens=False`` (keep_special_tokens), as vLLM's parser adjusts it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection

from lora_runner.entrypoints.openai.tool_calls.deltas import Extracted, ToolCallDelta, new_call_id
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import StreamingToolParser, unique_keys_decoder

BOT, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\s*(?:\[ARGS\])?\s*")


class MistralToolParser(StreamingToolParser):
    """Feeds of one choice's text -> Extracted (content, tool-call deltas); see the module docstring.
    offered: the names of the functions the request offered (only these become calls)."""

    keep_special_tokens = True  # [TOOL_CALLS] is a control token: decoding must keep it

    def __init__(self, offered: Collection[str]) -> None:
        super().__init__(offered)
        self._calling = False  # the buffer holds everything from [TOOL_CALLS] on

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """What `text` (the next piece of the output) adds; `finished`: the output ends here."""
        out = Extracted()
        self._buffer += text
        if not self._calling:
            start = self._content_until(out, BOT, finished)
            if start is not None:
                self._calling, self._buffer = True, self._buffer[start:]
        if finished:
            if self._calling:
                self._finish_calls(out)
            out.content += self._held_space
            self._held_space = ""
        return out

    def _finish_calls(self, out: Extracted) -> None:
        parsed = self._calls(self._buffer)
        if parsed is None:
            out.content += self._space_before + self._buffer
            return
        calls, trailing = parsed
        out.calls += [ToolCallDelta(self.num_calls + i, new_call_id(), name, arguments)
                      for i, (name, arguments) in enumerate(calls)]
        self.num_calls += len(calls)
        out.content += trailing

    def _calls(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        """([(name, arguments JSON)], the text after the calls) of `text` (which starts with [TOOL_CALLS]);
        None when it is no well-formed calls of offered functions."""
        rest = text[len(BOT):]
        if rest.lstrip().startswith("["):
            return self._call_list(rest)
        decoder, calls = unique_keys_decoder(), []
        while text.startswith(BOT):
            name = _NAME.match(text, len(BOT))
            if name is None or name.group(1) not in self.offered:
                return None
            try:
                arguments, end = decoder.raw_decode(text, name.end())
            except ValueError:
                return None
            if not isinstance(arguments, dict):
                return None
            calls.append((name.group(1), json.dumps(arguments, ensure_ascii=False)))
            text = text[end:]
            if text.lstrip().startswith(BOT):
                text = text.lstrip()
        return calls, text

    def _call_list(self, rest: str) -> tuple[list[tuple[str, str]], str] | None:
        """The pre-v11 form: one JSON array of {"name", "arguments"} objects, then trailing text."""
        start = len(rest) - len(rest.lstrip())
        try:
            array, end = unique_keys_decoder().raw_decode(rest, start)
        except ValueError:
            return None
        if not isinstance(array, list) or not array or BOT in rest[end:]:
            return None
        calls = []
        for call in array:
            if not isinstance(call, dict) or call.get("name") not in self.offered:
                return None
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):  # arguments already as JSON text: kept when they are an object
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    return None
            if not isinstance(arguments, dict):
                return None
            calls.append((call["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls, rest[end:]
