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


class JsonSchemaFormat(_Body):
    """``response_format.json_schema`` (OpenAI): the schema the output follows, named."""

    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # None: any JSON object
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Body):
    """``response_format`` (OpenAI): "text" (unconstrained), "json_object" (any JSON object), "json_schema"
    (``json_schema.schema``) or vLLM's "structural_tag" (``structures`` and ``triggers``, or ``format``)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict] | None = None  # structural_tag: [{"begin", "schema", "end"}]
    triggers: list[str] | None = None  # structural_tag: what opens a structure in free text
    format: dict | None = None  # structural_tag in xgrammar's newer form


class StructuredOutputsBody(_Body):
    """``structured_outputs`` (vLLM's request field): exactly one of json (a schema), regex, choice,
    grammar (EBNF, or Lark with the guidance backend), json_object or structural_tag (its JSON text)
    (lora_runner.StructuredOutputsParams)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    structural_tag: str | None = None
    backend: str | None = None  # the backend the request expects: a 400 when it is not the server's


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
    logit_bias: dict[str, float] | None = None  # token id (a string) -> a number in [-100, 100] added to its logit
    user: str | None = None  # an end-user id for the caller's own records; not used by the engine
    ignore_eos: bool = False  # extension (vLLM)
    stop_token_ids: list[int] | None = None  # extension (vLLM)
    include_stop_str_in_output: bool = False  # extension (vLLM)
    min_tokens: int = Field(default=0, ge=0)  # extension (vLLM)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)  # extension (vLLM): keep the last k
    prompt_adapter: str | None = None  # extension: a registered soft prompt, by name
    cache_salt: str | None = Field(default=None, min_length=1)  # extension (vLLM): added to the tenant's salt
    skip_special_tokens: bool = True  # extension (vLLM): special tokens left out of the text
    spaces_between_special_tokens: bool = True  # extension (vLLM)
    return_token_ids: bool = False  # extension (vLLM): prompt_token_ids and token_ids of each choice
    return_tokens_as_token_ids: bool = False  # extension (vLLM): logprobs' tokens as "token_id:N"
    # extension (vLLM): the top k logprobs at each prompt position (-1: the whole vocabulary; capped by
    # --max-logprobs; not with stream)
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    # structured outputs (lora_runner.entrypoints.openai.sampling.structured_outputs): at most one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None  # extension (vLLM)
    guided_json: dict | str | None = None  # extension (vLLM's older names of structured_outputs' fields)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    allowed_token_ids: list[int] | None = None  # extension (vLLM): only these ids may be sampled
    bad_words: list[str] | None = None  # extension (vLLM): words never generated


class CompletionRequest(_GenerationBody):
    """POST /v1/completions."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # 0 only with echo: the prompt scored, nothing generated (lora_runner.entrypoints.openai.echo)
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=-1)  # -1 (vLLM's): the whole vocabulary
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None


class TextPart(_Body):
    """A text part of a chat message's content."""

    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    """The function an assistant message's tool call called: its name and arguments (a JSON string)."""

    name: str
    arguments: str


class ToolCall(_Body):
    """One tool call of an assistant message (as a response's ``message.tool_calls`` holds them)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One chat message; content is a string or a list of text parts. An assistant message may
    carry the ``tool_calls`` it made; a ``tool`` message answers the call ``tool_call_id`` names."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Body):
    """A function the model may call: its name, what it does and its parameters' JSON schema
    (checked further in lora_runner.entrypoints.openai.tool_calls.definitions)."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # OpenAI's; the schema is enforced for forced choices either way


class ChatTool(_Body):
    """One entry of ``tools``: a function (the only kind of tool chat completions have)."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    """The function a named ``tool_choice`` forces."""

    name: str


class NamedToolChoice(_Body):
    """``tool_choice`` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_GenerationBody):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=-1)  # -1 (vLLM's): the whole vocabulary
    max_completion_tokens: int | None = Field(default=None, ge=1)
    echo: bool = False  # extension (vLLM): the last message's content before the reply when it is the assistant's
    # extensions (vLLM), rendered as LLM.chat renders them (lora_runner.entrypoints.openai.prompts.template_options)
    add_generation_prompt: bool = True  # the template's opening of the assistant's reply
    continue_final_message: bool = False  # the last (assistant) message left open, continued by the reply
    chat_template: str | None = None  # a Jinja template for this request (only with --trust-request-chat-template)
    chat_template_kwargs: dict | None = None  # extra variables the template sees ({"enable_thinking": false})


class LoadLoRARequest(_Body):
    """POST /v1/load_lora_adapter (vLLM's body). load_inplace: replace the adapter already served under
    lora_name (its old version serves until the new one has loaded; without it a taken name is a 400)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    # ours: the speculative draft model's adapter (LoRARequest.draft_lora_path), confined as lora_path is,
    # beneath the same directory
    draft_path: str | None = Field(default=None, min_length=1)


class UnloadLoRARequest(_Body):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is accepted and unused)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's body): a ``prompt``, or ``messages`` rendered as /v1/chat/completions
    renders them (its template fields and tools). add_special_tokens: the tokenizer's (BOS) around a
    prompt (default true, as vLLM); a chat prompt takes its special tokens from the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # vLLM: each token's text beside the ids
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[ChatTool] | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's body): the text of token ids."""

    model: str | None = None
    tokens: list[int]
