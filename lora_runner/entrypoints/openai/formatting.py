"""OpenAI response bodies: completions and chat completions, whole or as stream chunks.

A ``Delta`` is what one choice gained since the last chunk: text, per-token logprobs
(token string, logprob, top alternatives), tool-call deltas (chat with tools) and the finish reason
once it finished. A whole response's choices are made one at a time as its body is written
(response_body.LazyArray), and a prompt's prompt_logprobs, shared by its n choices, are serialised once
(response_body.SharedJSON).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from lora_runner.entrypoints.openai.response_body import LazyArray, SharedJSON, json_pieces
from lora_runner.entrypoints.openai.tool_calls.deltas import ToolCallDelta, join_calls, message_tool_calls

DONE_EVENT = "data: [DONE]\n\n"
ADAPTER_VERSION_HEADER = "X-Adapter-Version"  # the adapter version a generation ran with (provenance)


def adapter_provenance(output) -> dict | None:
    """{"name", "version"} of the adapter version a RequestOutput ran with (its LoRA, else its prompt
    adapter), or None for the base model."""
    ref = output.lora_version or output.prompt_adapter_version
    return None if ref is None else {"name": ref.name, "version": ref.version}


def _compact(value) -> str:
    return json.dumps(value, separators=(",", ":"))


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as JSON (a SharedJSON in it spliced as its one text)."""
    return f"data: {''.join(json_pieces(payload, _compact))}\n\n"


@dataclass
class TokenLogprob:
    """One token: its text, logprob and the top alternatives (text, logprob), best first. An echoed
    prompt's first token has neither (None): nothing predicts it."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


@dataclass
class Delta:
    """What a choice gained since the previous chunk."""

    index: int
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it (vLLM's field)
    token_ids: list[int] | None = None  # return_token_ids (vLLM): the generated ids of this delta
    prompt_token_ids: list[int] | None = None  # return_token_ids: the prompt's, in a choice's first delta
    tool_calls: list[ToolCallDelta] | None = None  # chat: tool-call pieces (whole calls in a response)
    # vLLM's field (echo.vllm_prompt_logprobs), first delta only: one object for the prompt's n choices
    prompt_logprobs: SharedJSON | None = None


@dataclass
class Usage:
    """Token counts of a response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def as_dict(self) -> dict:
        """OpenAI's usage object (with ``prompt_tokens_details.cached_tokens``)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass
class CompletionFormat:
    """Bodies of /v1/completions."""

    response_id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    role_chunk: bool = False  # chat opens each choice with a role-only chunk; completions do not
    # the adapter version the request ran with, {"name", "version"} (provenance; OpenAI clients ignore it)
    adapter: dict | None = None
    # per choice index: the text_offset of its next token (streamed offsets run over the whole choice)
    _text_offsets: dict[int, int] = field(default_factory=dict, repr=False)

    def _head(self) -> dict:
        return {"id": self.response_id, "object": "text_completion", "created": self.created, "model": self.model,
                **self._adapter()}

    def _adapter(self) -> dict:
        return {} if self.adapter is None else {"adapter": self.adapter}

    def chunk(self, delta: Delta, include_usage: bool, usage: Usage | None = None) -> dict:
        """A stream chunk for one choice's delta; with include_usage its "usage" is `usage` (the usage so
        far, stream_options.continuous_usage_stats) or null."""
        usage_field = {"usage": usage.as_dict() if usage is not None else None} if include_usage else {}
        return {**self._head(), "choices": [self._choice(delta)], **usage_field}

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk with stream_options.include_usage."""
        return {**self._head(), "choices": [], "usage": usage.as_dict()}

    def response(self, deltas: list[Delta], usage: Usage) -> dict:
        """The whole (non-streamed) response: each delta holds a choice's full text (its dict made as the body
        is written)."""
        return {**self._head(), "choices": LazyArray(self._choice, deltas), "usage": usage.as_dict()}

    def _choice(self, delta: Delta) -> dict:
        start = self._text_offsets.get(delta.index, 0)
        logprobs, self._text_offsets[delta.index] = _completion_logprobs(delta.logprobs, start)
        extra = {} if delta.prompt_logprobs is None else {"prompt_logprobs": delta.prompt_logprobs}
        return {"index": delta.index, "text": delta.text, "logprobs": logprobs,
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason, **_token_ids(delta), **extra}


@dataclass
class ChatFormat(CompletionFormat):
    """Bodies of /v1/chat/completions."""

    role_chunk: bool = True

    def _head(self, chunk: bool = True) -> dict:
        obj = "chat.completion.chunk" if chunk else "chat.completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                **self._adapter()}

    def opening_chunk(self, index: int, include_usage: bool) -> dict:
        """The first chunk of a choice: the assistant role and no content yet."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return {**self._head(), "choices": [choice], **({"usage": None} if include_usage else {})}

    def response(self, deltas: list[Delta], usage: Usage) -> dict:
        """The whole (non-streamed) chat completion."""
        choices = LazyArray(lambda d: {
            "index": d.index, "message": _message(d), "logprobs": _chat_logprobs(d.logprobs),
            "finish_reason": d.finish_reason, "stop_reason": d.stop_reason, **_token_ids(d, prompt=False)}, deltas)
        prompt_ids = next((d.prompt_token_ids for d in deltas if d.prompt_token_ids is not None), None)
        extra = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}  # vLLM: on the response
        prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None)
        if prompt_logprobs is not None:  # vLLM: on the chat response (one prompt), per choice on completions
            extra["prompt_logprobs"] = prompt_logprobs
        return {**self._head(chunk=False), "choices": choices, "usage": usage.as_dict(), **extra}

    @staticmethod
    def _choice(delta: Delta) -> dict:
        content = {"content": delta.text} if delta.text or (delta.finish_reason is None and not delta.tool_calls) \
            else {}
        if delta.tool_calls:
            # one entry per call: a client reading a call's first entry must see all of the chunk's text
            content["tool_calls"] = [call.as_chunk() for call in join_calls([], delta.tool_calls)]
        return {"index": delta.index, "delta": content, "logprobs": _chat_logprobs(delta.logprobs),
                "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason, **_token_ids(delta)}


def _token_ids(delta: Delta, prompt: bool = True) -> dict:
    """return_token_ids's fields of a choice (none without it): its generated ids and, with `prompt`, its
    prompt's ids where the delta carries them."""
    fields = {} if delta.token_ids is None else {"token_ids": delta.token_ids}
    if prompt and delta.prompt_token_ids is not None:
        fields["prompt_token_ids"] = delta.prompt_token_ids
    return fields


def _message(delta: Delta) -> dict:
    """A whole choice's message; with tool calls its content is null when the model wrote none (as OpenAI)."""
    if not delta.tool_calls:
        return {"role": "assistant", "content": delta.text}
    return {"role": "assistant", "content": delta.text or None, "tool_calls": message_tool_calls(delta.tool_calls)}


def _completion_logprobs(logprobs: list[TokenLogprob] | None, offset: int = 0) -> tuple[dict | None, int]:
    """(the legacy completions logprobs object, the text_offset after its last token). As OpenAI and
    vLLM: each token's top_logprobs holds the top k and the sampled token (k + 1 entries when it is
    not among them; with logprobs=0 the sampled token alone); text_offset counts from `offset`."""
    if logprobs is None:
        return None, offset
    offsets = []
    for entry in logprobs:
        offsets.append(offset)
        offset += len(entry.token)
    top = [None if e.top is None else {**dict(e.top), e.token: e.logprob} for e in logprobs]
    return {"tokens": [e.token for e in logprobs], "token_logprobs": [e.logprob for e in logprobs],
            "top_logprobs": top, "text_offset": offsets}, offset


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**entry(e.token, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                        for e in logprobs]}
