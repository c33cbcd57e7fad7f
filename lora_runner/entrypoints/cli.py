"""``lora-runner serve MODEL [options]`` (also ``python -m lora_runner.serve MODEL [options]``).

Argparse only: the options are serve_args' (parsed without loading the server), the parsed
options become frozen configs (EngineConfig, ServerConfig, StartupAdapters, RayConfig) once, and
those go to launch.build_state (one process) or to the Ray Serve application (ray.app)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from adapters import AdapterError, LoRARequest, PromptAdapterRequest
from lora_runner.config import EngineConfig
from lora_runner.entrypoints.engine_args import engine_config as engine_config_of
from lora_runner.entrypoints.launch import StartupAdapters, build_state
from lora_runner.entrypoints.listen_socket import bind_listen_socket, check_listen_address
from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.redact import public_model_name
from lora_runner.entrypoints.openai.shutdown import GracefulServer
from lora_runner.entrypoints.openai.state import ServerConfig
from lora_runner.entrypoints.openai.tenants import KeyRing
from lora_runner.entrypoints.ray.config import RayConfig, check_ray_serving
from lora_runner.entrypoints.startup_check import check_startup
from lora_runner.entrypoints.serve_args import (  # noqa: F401 - the command line's names, also read from here
    OneLineErrorParser,
    adapter_spec,
    add_ray_arguments,
    add_serve_arguments,
    command_parser,
    is_local_path,
)
from lora_runner.entrypoints.vllm_serve_flags import apply_vllm_engine_flags, check_vllm_serve_flags, load_chat_template

logger = logging.getLogger(__name__)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed options (--prompt-adapters turns prompt adapters on by default; vLLM's
    spellings of engine options applied first, ValueError naming one that cannot be honoured)."""
    apply_vllm_engine_flags(args)
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
    """The adapters named by --lora-modules (a JSON one's "draft_path": its draft_lora_path) and --prompt-adapters;
    ValueError for a prompt adapter with a draft_path."""
    if any(len(spec) > 3 for spec in args.prompt_adapters):
        raise ValueError("--prompt-adapters: draft_path names a LoRA of the speculative draft model; "
                         "give it in --lora-modules")
    return StartupAdapters(loras=tuple(LoRARequest(*spec[:3], draft_lora_path=spec[3] if len(spec) > 3 else None)
                                       for spec in args.lora_modules),
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
        if is_local_path(request.path) and not os.path.isdir(os.path.expanduser(request.path)):
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
    parser = command_parser()
    return run(parser.parse_args(argv), parser)


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
