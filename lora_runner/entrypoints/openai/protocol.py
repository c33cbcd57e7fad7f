"""Request bodies of the OpenAI-compatible routes (pydantic; unknown fields are rejected with 400).

Fields the engine cannot honour yet are accepted by the schema only so that the server can answer a
clear 400 naming them (see lora_runner.entrypoints.openai.sampling), never to ignore them silently.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    # NaN / Infinity (JSON tokens Python's parser accepts) are no number a tenant may send: 400 here;
    # the ranges of the sampling numbers are SamplingParams' (a ValueError there is a 400 too)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage and no choices;
    ``continuous_usage_stats`` (vLLM, with include_usage) puts the usage so far in every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _GenerationBody(_Body):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None  # extension (vLLM): -1 or None = off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension (vLLM): 0 or None = off
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None  # extension (vLLM)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records; not used by the engine
    ignore_eos: bool = False  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # extension (vLLM): keep the last k
    prompt_adapter: str | None = None  # extension: a registered soft prompt, by name
    cache_salt: str | None = Field(default=None, min_length=1)  # extension (vLLM): added to the tenant's salt


class CompletionRequest(_GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class TextPart(_Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class LoadLoRARequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body). load_inplace: replace the adapter already served under
    lora_name (its old version serves until the new one has loaded; without it a taken name is a 400)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False


class UnloadLoRARequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
