"""``lora-runner serve MODEL [options]`` (also ``python -m lora_runner.serve MODEL [options]``).

Argparse only: the engine options are generated from EngineConfig (engine_args), the parsed
options become frozen configs (EngineConfig, ServerConfig, StartupAdapters, RayConfig) once, and
those go to launch.build_state (one process) or to the Ray Serve application (ray.app)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import uvicorn

from adapters import AdapterError, LoRARequest, PromptAdapterRequest
from lora_runner.config import EngineConfig
from lora_runner.entrypoints.engine_args import add_engine_arguments
from lora_runner.entrypoints.engine_args import engine_config as engine_config_of
from lora_runner.entrypoints.launch import StartupAdapters, build_state
from lora_runner.entrypoints.listen_socket import bind_listen_socket, check_listen_address
from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.connections import ConnectionLimits
from lora_runner.entrypoints.openai.redact import public_model_name
from lora_runner.entrypoints.openai.shutdown import GracefulServer
from lora_runner.entrypoints.openai.state import ServerConfig
from lora_runner.entrypoints.openai.tenants import KeyRing
from lora_runner.entrypoints.ray.config import RayConfig, check_ray_serving
from lora_runner.entrypoints.startup_check import check_startup
from lora_runner.entrypoints.vllm_serve_flags import add_vllm_serve_arguments, check_vllm_serve_flags, load_chat_template

logger = logging.getLogger(__name__)


def adapter_spec(text: str) -> tuple[str, str, str | None]:
    """NAME=PATH[@REVISION] (@REVISION for Hub repo ids only: refused after a local directory, whose
    revision would be ignored), or vLLM's JSON form '{"name": ..., "path": ..., "base_model_name": ...}'
    -> (name, path, revision). base_model_name is accepted and not used: an adapter's parent in the
    model list is always the served base model."""
    if text.lstrip().startswith("{"):
        return _json_adapter_spec(text)
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[@REVISION], got {text!r}")
    if os.path.isdir(os.path.expanduser(rest)):  # a local folder whose name holds an "@"
        return name, rest, None
    path, _, revision = rest.partition("@")
    if revision and _is_local_path(path):
        raise argparse.ArgumentTypeError(f"{text!r}: @REVISION pins a Hub repo id; a local directory has no "
                                         f"revisions (drop '@{revision}')")
    return name, path, revision or None


def _is_local_path(path: str) -> bool:
    """A path meant as a local directory (adapters.hub reads a Hub id only when no such folder exists)."""
    return path.startswith(("/", "./", "../", "~")) or os.path.isdir(os.path.expanduser(path))


def _json_adapter_spec(text: str) -> tuple[str, str, str | None]:
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--lora-modules JSON: {exc}") from None
    unknown = set(spec) - {"name", "path", "base_model_name", "revision"} if isinstance(spec, dict) else set()
    if not isinstance(spec, dict) or unknown:
        raise argparse.ArgumentTypeError(f"--lora-modules JSON must be an object with name, path and optionally "
                                         f"base_model_name / revision, got {text!r}")
    name, path, revision = spec.get("name"), spec.get("path"), spec.get("revision")
    if not (isinstance(name, str) and name and isinstance(path, str) and path) or not (
            revision is None or isinstance(revision, str) and revision):
        raise argparse.ArgumentTypeError(f"--lora-modules JSON needs non-empty string name and path, got {text!r}")
    if revision and _is_local_path(path):
        raise argparse.ArgumentTypeError(f"{text!r}: revision pins a Hub repo id; a local directory has no revisions")
    return name, path, revision


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
        help="fraction of --max-pending-requests one tenant may hold when keys name several tenants (429)")
    add("--max-prompts-per-request", type=int, default=256, help="prompts in one completion request (400)")
    add("--max-chat-messages", type=int, default=1024, help="messages in one chat request (400)")
    add("--max-logprob-entries", type=int, default=ServerConfig.max_logprob_entries,
        help="logprob entries one response may carry, counted before it runs (400 over it)")
    add("--max-unsent-bytes", type=int, default=ServerConfig.max_unsent_bytes,
        help="output bytes, in all, finished responses may hold unsent after giving their seats back")
    add("--prompt-threads", type=int, default=2, help="threads that tokenize and render chat templates")
    add("--max-connections", type=int, default=ConnectionLimits.max_connections,
        help="open connections; past it the oldest without a request in progress is closed")
    add("--header-timeout", type=float, default=ConnectionLimits.header_timeout,
        help="seconds a connection has to send a request's headers")
    add("--max-header-bytes", type=int, default=ConnectionLimits.max_header_bytes,
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed options (--prompt-adapters turns prompt adapters on by default)."""
    return engine_config_of(args, prompt_adapters_given=bool(args.prompt_adapters))


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the parsed options (ValueError naming a vLLM flag this server cannot honour)."""
    check_vllm_serve_flags(args)
    served = args.served_model_name or public_model_name(args.model)  # a card never shows a server path
    alias = args.model if not args.served_model_name and served != args.model else None  # as vLLM: the path works
    return ServerConfig(served_model_name=served, model_path_alias=alias,
                        api_keys=tuple(args.api_key),
                        tenant_keys=args.tenant_keys,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating or runtime_updating_from_env(),
                        adapter_root=args.adapter_root, allow_hub_adapters=args.allow_hub_adapters,
                        allowed_adapter_paths=tuple(os.path.abspath(p) for p in args.allowed_adapter_paths),
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_limit=args.max_tokens_limit, max_pending_requests=args.max_pending_requests,
                        max_tenant_share=args.max_tenant_share, max_prompts_per_request=args.max_prompts_per_request,
                        max_chat_messages=args.max_chat_messages, prompt_threads=args.prompt_threads,
                        max_connections=args.max_connections, header_timeout=args.header_timeout,
                        max_header_bytes=args.max_header_bytes, shutdown_timeout=args.shutdown_timeout,
                        max_concurrent_loads=args.max_concurrent_loads, max_loads_per_tenant=args.max_loads_per_tenant,
                        adapter_load_timeout=args.adapter_load_timeout,
                        prefix_cache_tenant_salt=args.prefix_cache_tenant_salt,
                        stream_send_timeout=args.stream_send_timeout,
                        strict_request_fields=args.strict_request_fields,
                        chat_template=load_chat_template(args.chat_template),
                        trust_request_chat_template=args.trust_request_chat_template,
                        enable_log_requests=args.enable_log_requests, generation_config=args.generation_config,
                        tool_call_parser=args.tool_call_parser, max_logprob_entries=args.max_logprob_entries,
                        max_unsent_bytes=args.max_unsent_bytes)


def runtime_updating_from_env() -> bool:
    """vLLM's switch for the load/unload routes: VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 or true (any case)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


def startup_adapters(args: argparse.Namespace) -> StartupAdapters:
    """The adapters named by --lora-modules and --prompt-adapters."""
    return StartupAdapters(loras=tuple(LoRARequest(*spec) for spec in args.lora_modules),
                           prompt_adapters=tuple(PromptAdapterRequest(*spec) for spec in args.prompt_adapters))


def ray_config(args: argparse.Namespace) -> RayConfig:
    """RayConfig from the parsed options."""
    return RayConfig(num_replicas=args.num_replicas, address=args.ray_address, replica_cpus=args.replica_cpus,
                     replica_gpus=args.replica_gpus, max_adapters_per_replica=args.max_adapters_per_replica,
                     host=args.host, port=args.port)


def serve(args: argparse.Namespace) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn stops accepting, waits, then the engine shuts down).

    The configs are built (and validated) once here and handed to the server or the Ray replicas. The
    port is bound (Ray: checked) before the model loads, so a taken port is said at once."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine, server, adapters = engine_config(args), server_config(args), startup_adapters(args)
    check_local_adapter_paths(adapters)  # before minutes of model loading, and said once
    KeyRing.from_options(list(server.api_keys), server.tenant_keys)  # bad keys are said now, also for Ray
    layout = ray_config(args)
    if layout.enabled:
        check_ray_serving(server)
        check_listen_address(args.host, args.port)
        check_startup(engine, adapters)  # replicas would fail later, one by one: say it now
        try:  # imported here: Ray is an optional dependency (lora-runner[ray]), needed only for replicas
            from lora_runner.entrypoints.ray.app import serve_on_ray
        except ImportError as exc:
            raise ValueError("--num-replicas > 1 needs Ray Serve: pip install -e \".[ray]\" in the lora-runner checkout") from exc
        serve_on_ray(engine, server, adapters, layout)
        return
    sock = bind_listen_socket(args.host, args.port)
    try:
        if adapters.loras or adapters.prompt_adapters:
            check_startup(engine, adapters)  # a bad startup adapter: one line now, not after the model loads
        state = build_state(engine, server, adapters)
        config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=int(max(1, args.shutdown_timeout)),
                                **server.connection_limits.uvicorn_settings())
        AnnouncingServer(config, state, listen_url(sock)).run(sockets=[sock])
    finally:
        sock.close()


def check_local_adapter_paths(adapters: StartupAdapters) -> None:
    """ValueError naming the first startup adapter whose local directory (a path starting with /, ./,
    ../ or ~) does not exist; Hub ids and the files themselves are checked when the adapter loads."""
    for request in (*adapters.loras, *adapters.prompt_adapters):
        if _is_local_path(request.path) and not os.path.isdir(os.path.expanduser(request.path)):
            raise ValueError(f"adapter {request.name!r}: no such directory {request.path}")


def listen_url(sock) -> str:
    """http://HOST:PORT of a bound socket (the port it really got, also for --port 0)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class AnnouncingServer(GracefulServer):
    """Says once where it listens when uvicorn is up: uvicorn logs no address for sockets it is
    handed (we bind ours before the model loads)."""

    def __init__(self, config: uvicorn.Config, state, url: str) -> None:
        super().__init__(config, state)
        self.url = url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            logger.info("listening on %s", self.url)


def main(argv: list[str] | None = None) -> int:
    """``lora-runner serve MODEL [options]``."""
    parser = argparse.ArgumentParser(prog="lora-runner")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=OneLineErrorParser)
    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible HTTP server",
                                            formatter_class=argparse.ArgumentDefaultsHelpFormatter))
    return run(parser.parse_args(argv), parser)


class OneLineErrorParser(argparse.ArgumentParser):
    """A parser whose errors are one line (the usage of `serve` spans dozens, burying the error)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Serve; bad settings, a model that cannot be found (wrong path, Hub id not in the offline cache),
    a port that cannot be bound or bad startup adapters end with one line and exit status 2."""
    try:
        serve(args)
    except (ValueError, AdapterError, FileNotFoundError) as exc:
        logger.debug("startup failed", exc_info=True)  # the whole story for --log-level debug
        parser.exit(2, f"lora-runner: error: {_one_line(exc)}\n")
    return 0


def _one_line(exc: BaseException) -> str:
    """The exception's message on one line (huggingface_hub's messages span several)."""
    return " ".join(str(exc).split())


if __name__ == "__main__":
    sys.exit(main())
