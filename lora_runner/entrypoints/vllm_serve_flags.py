"""vLLM's ``vllm serve`` flags that ``lora-runner serve`` takes too: honoured where it can, refused with
one line naming the flag where it cannot (the reasons are vllm_compat's, which ``LLM`` gives for the
same keywords).

Honoured: ``--chat-template`` (a file, or the template itself), ``--trust-request-chat-template``,
``--generation-config`` (auto / vllm / a folder: requests' sampling defaults), ``--enable-log-requests``
(and the older ``--disable-log-requests``, a no-op: requests are not logged by default),
``--enable-auto-tool-choice`` (tool_choice "auto" is always served) and ``--tool-call-parser`` hermes,
llama3_json, pythonic, mistral, qwen3_xml or qwen3_coder (ServerConfig refuses the others), ``--tokenizer`` naming
the model itself, ``--lora-dtype auto``, ``--enable-tokenizer-info-endpoint`` (GET /tokenizer_info is always
served, to any valid key). The structured-output backend in vLLM's spellings (``apply_vllm_engine_flags`` sets
``--structured-outputs-backend`` from them): ``--structured-outputs-config`` (JSON, or one key at a time as
``--structured-outputs-config.backend guidance``) and the older ``--guided-decoding-backend`` and
``--guided-decoding-disable-*`` (vllm_compat.STRUCTURED_OUTPUTS_KEYS says which values are honoured).
Refused: ``--trust-remote-code``, another tokenizer, another LoRA dtype, the outlines and lm-format-enforcer
backends, an engine-wide disable_any_whitespace, a reasoning parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

from lora_runner.entrypoints.vllm_compat import STRUCTURED_OUTPUTS_KEYS, refusal, structured_outputs_backend

# characters a Jinja template has and a file path hardly ever: vLLM's test of "a template, not a path"
_JINJA_MARKS = ("{{", "{%", "{#")


def add_vllm_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's serve flags (see the module docstring) on `parser` (or an argument group of one)."""
    add = parser.add_argument
    add("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
        help="the Jinja chat template chat requests render with (a file, or the template itself) instead of "
             "the tokenizer's")
    add("--trust-request-chat-template", action="store_true",
        help="requests may bring their own chat_template (off: a template is code the server runs)")
    add("--generation-config", default="auto", metavar="auto|vllm|DIR",
        help="sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) for "
             "requests that leave them out: auto = the model's generation_config.json, vllm = none, or a "
             "folder holding a generation_config.json")
    add("--enable-log-requests", action="store_true",
        help="log each request's id, model, prompt length and sampling parameters (never its text)")
    add("--disable-log-requests", action="store_true", help="accepted for vLLM compatibility: the default")
    add("--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM compatibility: tool_choice \"auto\" is always served (see --tool-call-parser)")
    add("--tool-call-parser", default="hermes", metavar="NAME",
        help="how tool_choice \"auto\" reads calls: hermes (<tool_call> markup), llama3_json, pythonic, "
             "mistral ([TOOL_CALLS]), qwen3_xml or qwen3_coder (<function=...> markup)")
    add("--tokenizer", default=None, metavar="PATH", help="accepted when it names the model itself")
    add("--trust-remote-code", action="store_true", help="refused: models with custom code are not run")
    add("--lora-dtype", default="auto", help="accepted when auto (LoRA slots are kept in the model's dtype)")
    add("--enable-tokenizer-info-endpoint", action="store_true",
        help="accepted for vLLM compatibility: GET /tokenizer_info is always served (to any valid key)")
    add_structured_outputs_arguments(parser)


# vLLM's older structured-output flags -> the StructuredOutputsConfig key each sets
_GUIDED_DECODING_FLAGS = {"disable_fallback": "--guided-decoding-disable-fallback",
                          "disable_any_whitespace": "--guided-decoding-disable-any-whitespace",
                          "disable_additional_properties": "--guided-decoding-disable-additional-properties"}


def add_structured_outputs_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's structured-output flags (its StructuredOutputsConfig as JSON or key by key, and the older
    --guided-decoding-*), read by apply_vllm_engine_flags once everything is parsed."""
    add = parser.add_argument
    add("--structured-outputs-config", type=_json_object, default=None, metavar="JSON",
        help="vLLM's StructuredOutputsConfig, e.g. '{\"backend\": \"guidance\"}' (also key by key: "
             "--structured-outputs-config.backend guidance); sets --structured-outputs-backend (llguidance = "
             "guidance)")
    parser.set_defaults(structured_outputs_config_keys=None)
    for key in STRUCTURED_OUTPUTS_KEYS:
        spellings = dict.fromkeys((f"--structured-outputs-config.{key}",  # one spelling when the key has no "_"
                                   f"--structured-outputs-config.{key.replace('_', '-')}"))
        add(*spellings, action=_ConfigKey, nargs="?", const=True, help=argparse.SUPPRESS)
    add("--guided-decoding-backend", default=None, metavar="NAME",
        help="vLLM's older name of --structured-outputs-config.backend")
    for key, flag in _GUIDED_DECODING_FLAGS.items():
        add(flag, action="store_true", help=f"vLLM's older --structured-outputs-config.{key}")


class _ConfigKey(argparse.Action):
    """One key of --structured-outputs-config given alone (``--structured-outputs-config.backend guidance``):
    the value is read as JSON where it is JSON (true, false), else as text; without a value it is true."""

    def __call__(self, parser, namespace, value, option_string=None):
        keys = dict(namespace.structured_outputs_config_keys or {})
        key = option_string.split(".", 1)[1].replace("-", "_")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:  # text: a backend's name
                pass
        keys[key] = value
        namespace.structured_outputs_config_keys = keys


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object of StructuredOutputsConfig keys, got {text!r}")
    return value


def apply_vllm_engine_flags(args: argparse.Namespace) -> None:
    """Set args.structured_outputs_backend from vLLM's structured-output flags (ValueError, one line naming
    the flag and key, for what cannot be honoured, or when they and --structured-outputs-backend disagree)."""
    settings = []  # (the flag, the StructuredOutputsConfig keys it gives)
    config = {**(args.structured_outputs_config or {}), **(args.structured_outputs_config_keys or {})}
    if config:
        settings.append(("--structured-outputs-config", config))
    if args.guided_decoding_backend is not None:
        settings.append(("--guided-decoding-backend", {"backend": args.guided_decoding_backend}))
    settings += [(flag, {key: True}) for key, flag in _GUIDED_DECODING_FLAGS.items() if getattr(args, _dest(flag))]
    named = {flag: backend for flag, keys in settings
             if (backend := structured_outputs_backend(keys, flag)) is not None}
    if args.structured_outputs_backend != "auto":
        named = {"--structured-outputs-backend": args.structured_outputs_backend, **named}
    if len(set(named.values())) > 1:
        raise ValueError(" and ".join(f"{flag} {backend}" for flag, backend in named.items())
                         + " name different structured-output backends: pass one")
    if named:
        flag, backend = next(iter(named.items()))
        package, install = _BACKEND_PACKAGES[backend]
        if not _installed(package):  # said now, not by the first constrained request's 400
            raise ValueError(f"{flag} {backend} needs the {package} package, which is not installed: {install} "
                             "(or leave the backend to auto)")
        args.structured_outputs_backend = backend


# a backend -> (the package it imports, how to install it); xgrammar is an extra (pyproject.toml says why)
_BACKEND_PACKAGES = {"xgrammar": ("xgrammar", 'pip install -e ".[xgrammar]" in the lora-runner checkout'),
                     "guidance": ("llguidance", "pip install 'llguidance>=1.9'")}


def _installed(package: str) -> bool:
    """Whether `package` can be found without importing it (xgrammar's import takes seconds)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # ValueError: None in sys.modules, a module blocked on purpose
        return False


def _dest(flag: str) -> str:
    """The argparse dest of a --flag-name: flag_name."""
    return flag.removeprefix("--").replace("-", "_")


def check_vllm_serve_flags(args: argparse.Namespace) -> None:
    """ValueError (one line, naming the flag) for a vLLM serve flag whose value cannot be honoured."""
    if args.trust_remote_code:
        raise ValueError(f"--trust-remote-code is not supported: {refusal('trust_remote_code', True)}")
    if args.tokenizer is not None and not _same_path(args.tokenizer, args.model):
        raise ValueError(f"--tokenizer {args.tokenizer} is not supported: {refusal('tokenizer', args.tokenizer)}")
    if args.lora_dtype != "auto":
        raise ValueError(f"--lora-dtype {args.lora_dtype} is not supported: {refusal('lora_dtype', args.lora_dtype)}")
    generation_config = args.generation_config
    if generation_config not in ("auto", "vllm") and not os.path.isdir(os.path.expanduser(generation_config)):
        raise ValueError(f"--generation-config {generation_config}: expected auto, vllm or a folder holding "
                         "generation_config.json")


def load_chat_template(value: str | None) -> str | None:
    """The template of ``--chat-template``: a file's text, or the value itself when it is a template
    (ValueError for something that is neither: a path that does not exist)."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as file:
            return file.read()
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template either")


def _same_path(value: str, model: str) -> bool:
    return os.path.normpath(os.path.expanduser(value)) == os.path.normpath(os.path.expanduser(model))
