"""vLLM's ``vllm serve`` flags that ``lora-runner serve`` takes too: honoured where it can, refused with
one line naming the flag where it cannot (the reasons are vllm_compat's, which ``LLM`` gives for the
same keywords).

Honoured: ``--chat-template`` (a file, or the template itself), ``--trust-request-chat-template``,
``--generation-config`` (auto / vllm / a folder: requests' sampling defaults), ``--enable-log-requests``
(and the older ``--disable-log-requests``, a no-op: requests are not logged by default),
``--enable-auto-tool-choice`` (tool_choice "auto" is always served) and ``--tool-call-parser`` hermes,
llama3_json, pythonic, mistral, qwen3_xml or qwen3_coder (ServerConfig refuses the others), ``--tokenizer`` naming the model itself, ``--lora-dtype auto``.
Refused: ``--trust-remote-code``, another tokenizer, another LoRA dtype.
"""

from __future__ import annotations

import argparse
import os

from lora_runner.entrypoints.vllm_compat import refusal

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
