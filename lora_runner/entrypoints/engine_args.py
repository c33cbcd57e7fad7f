"""The engine options of ``lora-runner serve``, generated from ``dataclasses.fields(EngineConfig)``.

Every EngineConfig field is one option (``max_num_seqs`` -> ``--max-num-seqs``; ``model`` is the
positional argument) with the field's type, default and description (its ``metadata["help"]``),
as vLLM builds its CLI from EngineArgs and nano-vllm its Config from ``fields(Config)``: a field
added to EngineConfig is an option without a line here, and each limit is set in one place.
Types: ``int``, ``float``, ``str`` (also ``str | torch.dtype``), each optionally ``| None`` (the
default then stays None unless the option is given), and ``bool`` as ``--flag/--no-flag``.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from lora_runner.config import EngineConfig

DEFAULT_PROMPT_ADAPTER_TOKENS = 64  # virtual tokens per soft prompt when --prompt-adapters enables them

# today's spellings kept working beside the generated names, and vLLM's short ones
ALIASES = {"max_prompt_adapter_tokens": ("--max-prompt-adapter-token",), "tensor_parallel_size": ("-tp",)}
# options whose default follows other options (None on the command line; resolved by engine_config)
DERIVED_DEFAULTS = {
    "max_prompt_adapters": "1 when --prompt-adapters is given, else 0",
    "max_prompt_adapter_tokens": f"{DEFAULT_PROMPT_ADAPTER_TOKENS} when prompt adapters are enabled, else 0",
}


_METAVARS = {int: "N", float: "X", str: "TEXT"}


class _TorchTypes:
    """Stands for torch in EngineConfig's type hints (``str | torch.dtype``): an option reads such a field
    as its str, so building the command line (``serve --help`` included) need not import torch."""

    dtype = device = type("TorchType", (), {})


def option_name(field_name: str) -> str:
    """The option of an EngineConfig field: ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One option per EngineConfig field (the positional ``model`` included) on `parser` (or an
    argument group of one).

    Raises ValueError for a field without ``metadata["help"]`` and TypeError for a field type
    the command line cannot express: a new field must say what it is before it ships."""
    hints = typing.get_type_hints(EngineConfig, localns={"torch": _TorchTypes})
    for field in dataclasses.fields(EngineConfig):
        text = field.metadata.get("help")
        if not text:
            raise ValueError(f"EngineConfig.{field.name} has no description: give it "
                             "field(metadata={'help': ...}) in lora_runner/config.py")
        text = text.replace("%", "%%")  # argparse formats help with %
        if field.default is dataclasses.MISSING:
            parser.add_argument(field.name, help=text)
            continue
        kind = _cli_type(field.name, hints[field.name])
        names = (option_name(field.name), *ALIASES.get(field.name, ()))
        if field.name in DERIVED_DEFAULTS:
            default, text = None, f"{text} (default: {DERIVED_DEFAULTS[field.name]})"
        else:
            default, text = field.default, f"{text} (default: %(default)s)"
        if kind is bool:
            parser.add_argument(*names, dest=field.name, action=argparse.BooleanOptionalAction, default=default,
                                help=text)
        else:
            parser.add_argument(*names, dest=field.name, type=kind, default=default, help=text,
                                metavar=_METAVARS[kind])


def engine_config(args: argparse.Namespace, prompt_adapters_given: bool = False) -> EngineConfig:
    """The EngineConfig of parsed options (ValueError for settings EngineConfig refuses).

    prompt_adapters_given: startup soft prompts were named, so prompt adapters default to on
    (1 slot of DEFAULT_PROMPT_ADAPTER_TOKENS tokens) unless the options set them."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(EngineConfig)}
    if values["max_prompt_adapters"] is None:
        values["max_prompt_adapters"] = 1 if prompt_adapters_given else 0
    if values["max_prompt_adapter_tokens"] is None:
        values["max_prompt_adapter_tokens"] = DEFAULT_PROMPT_ADAPTER_TOKENS if values["max_prompt_adapters"] else 0
    return EngineConfig(**values)


def _cli_type(name: str, hint) -> type:
    """The type that parses a field's option, from its type hint (``X | None``: X's)."""
    is_union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    members = typing.get_args(hint) if is_union else (hint,)
    for kind in (bool, int, float, str):  # bool first: a bool is an int too
        if kind in members:
            return kind
    raise TypeError(f"EngineConfig.{name}: no command-line option for type {hint!r}; "
                    "extend lora_runner.entrypoints.engine_args._cli_type")
