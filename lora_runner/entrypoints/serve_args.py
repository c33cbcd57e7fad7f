"""The command line of ``lora-runner serve`` (and ``python -m lora_runner.serve``): its options and the
adapter specs they take, built without the server, the engine or torch, so that ``--help`` and a bad
option answer at once; lora_runner.entrypoints.cli runs what they parse.

The engine options are generated from EngineConfig (engine_args); the server's are listed here with
ServerConfig's and ConnectionLimits' defaults (SERVER_DEFAULTS: repeated, not imported, since those
modules load the server; a test holds them equal)."""

from __future__ import annotations

import argparse
import json
import os

from lora_runner.entrypoints.engine_args import add_engine_arguments
from lora_runner.entrypoints.vllm_serve_flags import add_vllm_serve_arguments

# ServerConfig's and ConnectionLimits' defaults of the options below (tests/test_first_contact_round3.py
# checks them against those classes)
SERVER_DEFAULTS = {"max_logprob_entries": 1_000_000, "max_unsent_bytes": 64 << 20, "max_connections": 512,
                   "header_timeout": 10.0, "max_header_bytes": 64 << 10}


def adapter_spec(text: str) -> tuple[str, ...]:
    """NAME=PATH[@REVISION] (@REVISION for Hub repo ids only: refused after a local directory, whose
    revision would be ignored), or vLLM's JSON form '{"name": ..., "path": ..., "base_model_name": ...}'
    -> (name, path, revision). base_model_name is accepted and not used: an adapter's parent in the
    model list is always the served base model. The JSON form's "draft_path" (ours: the speculative draft
    model's adapter, LoRARequest.draft_lora_path) adds a fourth item."""
    if text.lstrip().startswith("{"):
        return _json_adapter_spec(text)
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[@REVISION], got {text!r}")
    if os.path.isdir(os.path.expanduser(rest)):  # a local folder whose name holds an "@"
        return name, rest, None
    path, _, revision = rest.partition("@")
    if revision and is_local_path(path):
        raise argparse.ArgumentTypeError(f"{text!r}: @REVISION pins a Hub repo id; a local directory has no "
                                         f"revisions (drop '@{revision}')")
    return name, path, revision or None


def is_local_path(path: str) -> bool:
    """A path meant as a local directory (adapters.hub reads a Hub id only when no such folder exists)."""
    return path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(path))


def _json_adapter_spec(text: str) -> tuple[str, ...]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--lora-modules JSON: {exc}") from None
    unknown = set(spec) - {"name", "path", "base_model_name", "revision", "draft_path"} if isinstance(spec, dict) \
        else set()
    if not isinstance(spec, dict) or unknown:
        raise argparse.ArgumentTypeError(f"--lora-modules JSON must be an object with name, path and optionally "
                                         f"base_model_name / revision / draft_path, got {text!r}")
    name, path, revision = spec.get("name"), spec.get("path"), spec.get("revision")
    if not (isinstance(name, str) and name and isinstance(path, str) and path) or not (
            revision is None or isinstance(revision, str) and revision):
        raise argparse.ArgumentTypeError(f"--lora-modules JSON needs non-empty string name and path, got {text!r}")
    if revision and is_local_path(path):
        raise argparse.ArgumentTypeError(f"{text!r}: revision pins a Hub repo id; a local directory has no revisions")
    draft = spec.get("draft_path")
    if draft is None:
        return name, path, revision
    if not isinstance(draft, str) or not draft:
        raise argparse.ArgumentTypeError(f"--lora-modules JSON draft_path must be a non-empty string, got {text!r}")
    return name, path, revision, draft


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `serve`: the engine's (one per EngineConfig field), the server's, Ray Serve's."""
    add_engine_arguments(parser.add_argument_group("engine (EngineConfig)"))
    server = parser.add_argument_group("server")
    add = server.add_argument
    add("--host", default="127.0.0.1", help="address to bind")
    add("--port", type=int, default=8000, help="port to bind")
    add("--lora-modules", nargs="+", type=adapter_spec, default=[], metavar="NAME=PATH[@REVISION]",
        help='adapters served from the start; also vLLM\'s JSON form \'{"name": ..., "path": ...}\'')
    add("--enable-lora", action="store_true",
        help="accepted for vLLM compatibility: LoRA is always enabled (size it with --max-loras, --max-lora-rank)")
    add("--prompt-adapters", nargs="+", type=adapter_spec, default=[], metavar="NAME=PATH",
        help="prompt-tuning adapters (soft prompts) served from the start")
    add("--api-key", action="append", default=[], help="a key with full access (repeatable)")
    add("--tenant-keys", default=None, metavar="FILE", help="JSON or YAML: key -> {adapters, base, admin}")
    add("--allow-runtime-lora-updating", action="store_true",
        help="enable /v1/load_lora_adapter and /v1/unload_lora_adapter (needs --adapter-root or "
             "--allowed-adapter-paths; also VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, as vLLM)")
    add("--adapter-root", default=None, metavar="DIR", help="runtime loads only from inside this directory")
    add("--allow-hub-adapters", action="store_true", help="runtime loads may name Hub repo ids")
    add("--allowed-adapter-paths", nargs="+", default=[], metavar="DIR",
        help="runtime loads may also name absolute paths inside these directories (no symlinks followed below them)")
    add("--max-concurrent-loads", type=int, default=4, help="runtime adapter loads at once (more: 503)")
    add("--max-loads-per-tenant", type=int, default=1, help="runtime adapter loads at once per tenant key (more: 429; "
        "--api-key keys and a keyless server are bound by --max-concurrent-loads only)")
    add("--adapter-load-timeout", type=float, default=60.0, metavar="SECONDS",
        help="a runtime load not done by then answers 504 (and is undone if it succeeds later)")
    add("--served-model-name", default=None, help="the base model's name in requests (default: the model path)")
    add("--max-body-bytes", type=int, default=1 << 20, help="largest request body (413 beyond)")
    add("--max-prompt-tokens", type=int, default=None, help="longest prompt in tokens (default: max_model_len)")
    add("--max-tokens-limit", type=int, default=None, help="largest max_tokens a request may ask for "
        "(default: max_model_len)")
    add("--max-pending-requests", type=int, default=1024, help="sequences (prompts x n) in flight; 503 beyond")
    add("--max-tenant-share", type=float, default=0.5,
        help="fraction of --max-pending-requests (and of --max-unsent-bytes' responses being built, and of "
        "--max-memory-adapter-bytes' in-memory adapter snapshots) one tenant may hold when keys name several "
        "tenants (429)")
    add("--max-prompts-per-request", type=int, default=256, help="prompts in one completion request (400)")
    add("--max-chat-messages", type=int, default=1024, help="messages in one chat request (400)")
    add("--max-logprob-entries", type=int, default=SERVER_DEFAULTS["max_logprob_entries"],
        help="logprob entries one response may carry, counted before it runs (400 over it)")
    add("--max-unsent-bytes", type=int, default=SERVER_DEFAULTS["max_unsent_bytes"],
        help="output bytes, in all, finished responses may hold unsent after giving their seats back")
    add("--prompt-threads", type=int, default=2, help="threads that tokenize and render chat templates")
    add("--max-connections", type=int, default=SERVER_DEFAULTS["max_connections"],
        help="open connections; past it the oldest without a request in progress is closed")
    add("--header-timeout", type=float, default=SERVER_DEFAULTS["header_timeout"],
        help="seconds a connection has to send a request's headers")
    add("--max-header-bytes", type=int, default=SERVER_DEFAULTS["max_header_bytes"],
        help="request header bytes a connection may send (closed beyond)")
    add("--shutdown-timeout", type=float, default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM before they are aborted")
    add("--prefix-cache-tenant-salt", action=argparse.BooleanOptionalAction, default=True,
        help="salt prefix-cache keys by tenant, so tenants never share cached KV (--no-...: single tenant)")
    add("--stream-send-timeout", type=float, default=30.0,
        help="seconds a streamed chunk may wait for its client to read it; then the request is aborted")
    add("--strict-request-fields", action="store_true",
        help="unknown fields in a generation request are a 400 (default: ignored, logged, named in X-Ignored-Fields)")
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
        help="log level of the server and the engine")
    add_vllm_serve_arguments(parser.add_argument_group("vLLM's serve flags"))
    add_ray_arguments(parser.add_argument_group("Ray Serve (with --num-replicas > 1; needs lora-runner[ray])"))


def add_ray_arguments(parser: argparse.ArgumentParser) -> None:
    """The Ray Serve options of `serve` (used when --num-replicas > 1; needs lora-runner[ray])."""
    add = parser.add_argument
    add("--num-replicas", type=int, default=1, help="engine replicas; > 1 serves on Ray Serve")
    add("--ray-address", default=None, help="join this Ray cluster (default: start a local Ray instance)")
    add("--replica-cpus", type=float, default=1.0, help="CPUs reserved per engine replica")
    add("--replica-gpus", type=float, default=0.0, help="GPUs reserved per engine replica")
    add("--max-adapters-per-replica", type=int, default=None,
        help="LoRAs a replica keeps registered (Serve's multiplex LRU; default: --max-cpu-loras or --max-loras)")


class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose errors are one line (the usage of `serve` spans dozens, burying the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def serve_parser(prog: str = "python -m lora_runner.serve") -> argparse.ArgumentParser:
    """The parser of ``python -m lora_runner.serve MODEL [options]``; its errors are one line."""
    parser = OneLineErrorParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_arguments(parser)
    return parser


def command_parser() -> argparse.ArgumentParser:
    """The parser of the ``lora-runner`` command (``lora-runner serve MODEL [options]``); its errors are one line."""
    parser = argparse.ArgumentParser(prog="lora-runner")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                                            formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return parser
