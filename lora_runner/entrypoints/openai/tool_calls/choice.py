"""A chat request's ``tools`` and ``tool_choice`` as a plan: what the chat template sees, the output
constraint the engine enforces, and the parser that reads the calls back out of the output.

As vLLM: ``tool_choice`` defaults to "auto" with tools and "none" without; "none" still renders the
tools into the prompt (vLLM's default, without --exclude-tools-when-tool-choice-none) but never
parses calls; "auto" parses Hermes-style ``<tool_call>`` markup (or, with --tool-call-parser, Llama 3 JSON or pythonic
calls: whole_call_parsers; Mistral's [TOOL_CALLS]: mistral_parser; Qwen3-Coder's XML: qwen3_xml_parser); "required" constrains the output to a
JSON array of at least one {"name", "arguments"} call of the given tools; a named function
constrains the output to that function's parameters schema (the output is the call's arguments).
A function declared without ``parameters`` takes none (OpenAI's meaning): its arguments are ``{}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.protocol import ChatCompletionRequest, NamedToolChoice
from lora_runner.entrypoints.openai.tool_calls.definitions import checked_tools, embedded_schemas
from lora_runner.entrypoints.openai.tool_calls.deltas import Extracted
from lora_runner.entrypoints.openai.tool_calls.forced_parsers import NamedFunctionParser, RequiredCallsParser
from lora_runner.entrypoints.openai.tool_calls.hermes_parser import HermesToolParser
from lora_runner.entrypoints.openai.tool_calls.mistral_parser import MistralToolParser
from lora_runner.entrypoints.openai.tool_calls.qwen3_xml_parser import Qwen3XmlToolParser
from lora_runner.entrypoints.openai.tool_calls.whole_call_parsers import Llama3JsonToolParser, PythonicToolParser
from lora_runner.structured_outputs_params import StructuredOutputsParams

# the parameters of a function that declares none: OpenAI's "no arguments" (the empty object)
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools. tools: the definitions for the chat template (None: no
    tools); structured: the output constraint of a forced choice; new_parser: one parser per choice
    (None: the output is plain content); keep_special_tokens: the parser reads a special token (Mistral's
    [TOOL_CALLS]), so the output is decoded with skip_special_tokens=False, as vLLM's parser asks."""

    tools: list[dict] | None = None
    structured: StructuredOutputsParams | None = None
    new_parser: Callable[[], object] | None = None
    keep_special_tokens: bool = False

    def parser_factory(self, stream: bool) -> Callable[[], object] | None:
        """The parser of each choice: incremental for a stream, reading the whole output otherwise (so
        a call that turns out malformed late is content, which a stream can no longer make it)."""
        if self.new_parser is None or stream:
            return self.new_parser
        return lambda: WholeOutput(self.new_parser())


class WholeOutput:
    """A parser that sees the output once, when it ends (the non-streamed response)."""

    def __init__(self, parser) -> None:
        self.parser, self._text = parser, ""

    @property
    def called(self) -> bool:
        """Whether the output held tool calls."""
        return self.parser.called

    def feed(self, text: str, finished: bool = False) -> Extracted:
        """Nothing until the output ends, then what the whole output holds."""
        self._text += text
        return self.parser.feed(self._text, True) if finished else Extracted()


# tool_choice "auto"'s parser of each --tool-call-parser name (vLLM's names); each is built from the offered
# functions' {name: parameters schema} (a name collection to most; qwen3's reads the arguments' types from it)
AUTO_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "pythonic": PythonicToolParser,
                "mistral": MistralToolParser, "qwen3_xml": Qwen3XmlToolParser, "qwen3_coder": Qwen3XmlToolParser}


def tool_plan(body: ChatCompletionRequest, auto_parser: str = "hermes") -> ToolPlan:
    """The request's plan; 400 for bad tools, a tool_choice without tools, or a name not among them.
    auto_parser: the AUTO_PARSERS entry that reads tool_choice "auto"'s calls (--tool-call-parser)."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: name the functions the model may call in tools",
                           "invalid_tool_choice")
        return ToolPlan()
    tools = checked_tools(body.tools)
    parameters = {tool.function.name: NO_ARGUMENTS if tool.function.parameters is None else tool.function.parameters
                  for tool in body.tools}
    if choice == "none":
        return ToolPlan(tools)
    offered = frozenset(parameters)  # only these names become tool calls
    if choice in (None, "auto"):
        parser = AUTO_PARSERS[auto_parser]
        return ToolPlan(tools, None, lambda: parser(parameters),
                        keep_special_tokens=getattr(parser, "keep_special_tokens", False))
    if choice == "required":
        return ToolPlan(tools, _structured(required_calls_schema(parameters)), lambda: RequiredCallsParser(offered))
    return _named(tools, parameters, choice)


def _named(tools: list[dict], parameters: dict[str, dict], choice: NamedToolChoice) -> ToolPlan:
    name = choice.function.name
    if name not in parameters:
        raise APIError(400, f"tool_choice names the function {name[:80]!r}, which is not among the tools",
                       "invalid_tool_choice")
    return ToolPlan(tools, _structured(parameters[name]), lambda: NamedFunctionParser(name))


def required_calls_schema(parameters: dict[str, dict]) -> dict:
    """The JSON schema of a list of at least one call: each {"name": one of the tools, "arguments": its parameters}.
    Each parameters schema moves into the root's ``$defs`` (embedded_schemas), so its own root-relative
    ``$ref``s (pydantic's ``#/$defs/...``) still resolve."""
    defs, arguments = embedded_schemas(parameters)
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]}, "arguments": arguments[name]},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name in parameters]
    schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    return {**schema, "$defs": defs} if defs else schema


def _structured(schema: dict) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except ValueError as exc:  # the tools' schemas over the constraint size limit
        raise APIError(400, f"tools: {exc}", "tools_too_large") from exc
