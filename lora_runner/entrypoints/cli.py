"""``lora-runner serve MODEL [options]`` (also ``python -m lora_runner.serve MODEL [options]``)."""

from __future__ import annotations

import argparse
import logging
import sys

from adapters import AdapterError, LoRARequest, PromptAdapterRequest
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.config import EngineConfig
from lora_runner.engine.llm_engine import LLMEngine
from lora_runner.entrypoints.openai.app import build_app
from lora_runner.entrypoints.openai.shutdown import GracefulServer
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing

logger = logging.getLogger(__name__)

DEFAULT_PROMPT_ADAPTER_TOKENS = 64


def adapter_spec(text: str) -> tuple[str, str, str | None]:
    """NAME=PATH[@REVISION] -> (name, path, revision)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH[@REVISION], got {text!r}")
    path, _, revision = rest.partition("@")
    return name, path, revision or None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `serve`."""
    add = parser.add_argument
    add("model", help="base model: a local directory or a Hugging Face Hub repo id")
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8000)
    add("--lora-modules", nargs="+", type=adapter_spec, default=[], metavar="NAME=PATH[@REVISION]")
    add("--prompt-adapters", nargs="+", type=adapter_spec, default=[], metavar="NAME=PATH")
    add("--max-loras", type=int, default=4)
    add("--max-lora-rank", type=int, default=16)
    add("--max-cpu-loras", type=int, default=None)
    add("--max-prompt-adapters", type=int, default=None, help="default: 1 when --prompt-adapters is given, else 0")
    add("--max-prompt-adapter-token", type=int, default=None,
        help=f"default: {DEFAULT_PROMPT_ADAPTER_TOKENS} when prompt adapters are enabled")
    add("--max-num-seqs", type=int, default=64)
    add("--max-model-len", type=int, default=None)
    add("--device", default="auto")
    add("--dtype", default="auto")
    add("--enforce-eager", action="store_true")
    add("--cpu-threads", type=int, default=None,
        help="intra-op threads on CPU (default: the physical cores available to the process)")
    add("--seed", type=int, default=0)
    add("--api-key", action="append", default=[], help="a key with full access (repeatable)")
    add("--tenant-keys", default=None, metavar="FILE", help="JSON or YAML: key -> {adapters, base, admin}")
    add("--allow-runtime-lora-updating", action="store_true")
    add("--adapter-root", default=None, metavar="DIR", help="runtime loads only from inside this directory")
    add("--allow-hub-adapters", action="store_true", help="runtime loads may name Hub repo ids")
    add("--served-model-name", default=None)
    add("--max-body-bytes", type=int, default=1 << 20)
    add("--max-prompt-tokens", type=int, default=None)
    add("--max-tokens-limit", type=int, default=None)
    add("--max-logprobs", type=int, default=20)
    add("--max-pending-requests", type=int, default=1024)
    add("--shutdown-timeout", type=float, default=10.0)
    add("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_ray_arguments(parser)


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
    """EngineConfig from the parsed options."""
    prompt_slots = args.max_prompt_adapters
    if prompt_slots is None:
        prompt_slots = 1 if args.prompt_adapters else 0
    prompt_tokens = args.max_prompt_adapter_token
    if prompt_tokens is None:
        prompt_tokens = DEFAULT_PROMPT_ADAPTER_TOKENS if prompt_slots else 0
    return EngineConfig(model=args.model, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                        max_cpu_loras=args.max_cpu_loras, max_prompt_adapters=prompt_slots,
                        max_prompt_adapter_tokens=prompt_tokens, device=args.device, dtype=args.dtype,
                        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                        enforce_eager=args.enforce_eager, seed=args.seed,
                        cpu_threads=args.cpu_threads)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """ServerConfig from the parsed options."""
    return ServerConfig(served_model_name=args.served_model_name or args.model,
                        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
                        adapter_root=args.adapter_root, allow_hub_adapters=args.allow_hub_adapters,
                        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                        max_tokens_limit=args.max_tokens_limit, max_logprobs=args.max_logprobs,
                        max_pending_requests=args.max_pending_requests, shutdown_timeout=args.shutdown_timeout)


def build_state(args: argparse.Namespace) -> ServerState:
    """Engine, keys and the startup adapters (each loaded and validated now: a bad one fails startup)."""
    config = server_config(args)
    keys = KeyRing.from_options(args.api_key, args.tenant_keys)
    if config.allow_runtime_lora_updating and not keys.enabled:
        logger.warning("runtime adapter loading is enabled without API keys: any caller may load adapters")
    state = ServerState(AsyncLLMEngine(LLMEngine(engine_config(args))), config, keys)
    try:
        for name, path, revision in args.lora_modules:
            state.add_lora(LoRARequest(name, path, revision))
        for name, path, revision in args.prompt_adapters:
            state.add_prompt_adapter(PromptAdapterRequest(name, path, revision))
    except BaseException:
        state.engine.shutdown()
        raise
    return state


def serve(args: argparse.Namespace) -> None:
    """Run the server until SIGINT/SIGTERM (uvicorn stops accepting, waits, then the engine shuts down)."""
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_replicas > 1:
        from lora_runner.entrypoints.ray.run import serve_on_ray

        serve_on_ray(args)
        return
    state = build_state(args)
    config = uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(max(1, args.shutdown_timeout)))
    GracefulServer(config, state).run()


def main(argv: list[str] | None = None) -> int:
    """``lora-runner serve MODEL [options]``."""
    parser = argparse.ArgumentParser(prog="lora-runner")
    commands = parser.add_subparsers(dest="command", required=True)
    add_serve_arguments(commands.add_parser("serve", help="OpenAI-compatible HTTP server"))
    return run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Serve; bad settings or startup adapters end with a message and exit status 2."""
    try:
        serve(args)
    except (ValueError, AdapterError) as exc:
        parser.exit(2, f"lora-runner: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
