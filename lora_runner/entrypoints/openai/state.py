"""What every route needs: the async engine (whose version table is the adapter registry), server settings,
keys, metrics."""

from __future__ import annotations

import asyncio
import logging
import math
import os
import uuid
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from adapters import LoRARequest, PromptAdapterRequest
from adapters.versions import ServedAdapter
from lora_runner.engine.protocol import EngineClient
from lora_runner.entrypoints.openai.connections import ConnectionLimits
from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.generation_defaults import SamplingDefaults
from lora_runner.entrypoints.openai.load_executor import LoadExecutor
from lora_runner.entrypoints.openai.metrics import ServerMetrics
from lora_runner.entrypoints.openai.tenants import KeyRing, Tenant
from lora_runner.entrypoints.openai.tool_calls.choice import AUTO_PARSERS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """Server settings (the engine's are in EngineConfig). Validated on construction (ValueError).

    served_model_name: the base model's name in ``model``. api_keys / tenant_keys: keys with full
    access / a JSON or YAML file of tenant keys (lora_runner.entrypoints.openai.tenants; neither: no
    authentication). allow_runtime_lora_updating / adapter_root / allow_hub_adapters: the
    load/unload routes (see adapter_root). allowed_adapter_paths: absolute directories beneath which
    runtime loads may name absolute paths (each an existing directory).
    max_body_bytes, max_prompt_tokens, max_tokens_limit,
    max_n: request size limits (None: the engine's max_model_len; the logprobs limit is the
    engine's max_logprobs). max_prompts_per_request / max_chat_messages: counts checked before any
    tokenization (400). max_pending_requests: sequences (prompts x n) in flight at once, beyond
    which requests get 503. max_tenant_share: the fraction of those one tenant may hold when the
    keys name several tenants (429 over it). prompt_threads: the bounded pool that tokenizes and
    renders chat templates off the event loop. max_connections / header_timeout /
    max_header_bytes: the connection limits (lora_runner.entrypoints.openai.connections).
    shutdown_timeout: seconds in-flight requests get to finish on SIGTERM.
    prefix_cache_tenant_salt: salt every request's prefix-cache keys with its tenant's name, so two
    tenants never share cached KV (whose hits would show in time to first token); turn off for a
    single-tenant deployment whose keys should share the cache.
    max_concurrent_loads / max_loads_per_tenant / adapter_load_timeout: runtime adapter loads at
    once in all (503 beyond) and per tenant (429 beyond), and the seconds a load's caller waits
    (504 after; see load_executor).
    strict_request_fields: a generation request with a field the server does not know is a 400
    (default: the field is ignored, logged and named in the X-Ignored-Fields header, as vLLM ignores it).
    chat_template: the Jinja template chat requests render with instead of the tokenizer's
    (--chat-template). trust_request_chat_template: a request may bring its own template (vLLM's flag;
    off by default, as in vLLM: a template is code the server runs). enable_log_requests: log each
    generation request's id, model, prompt length and sampling parameters at INFO (never its text).
    generation_config: where requests' sampling defaults come from (generation_defaults: "auto", "vllm"
    or a folder). tool_call_parser: how tool_choice "auto"'s calls are read (tool_calls.choice.AUTO_PARSERS).
    stream_send_timeout: seconds one chunk of a streamed response may wait for its client to take
    it; past that the client is taken to have stopped reading: its requests are aborted and the
    connection closed.
    max_logprob_entries: the logprob entries (a token's logprob or one top alternative) one request's
    response may carry, counted before it runs (400 over it; None: unbounded): n, prompts, echo and
    prompt_logprobs multiply a response to hundreds of MiB otherwise. max_unsent_bytes: the output, in
    all, that responses whose generation has ended may hold unsent while their seats are given back
    (a response over what is left keeps its seats until it is sent or its send times out).
    """

    served_model_name: str
    model_path_alias: str | None = None  # the model's path when the served name is its basename: requests may name it
    api_keys: tuple[str, ...] = ()
    tenant_keys: str | None = None
    allow_runtime_lora_updating: bool = False
    adapter_root: str | None = None
    allow_hub_adapters: bool = False
    allowed_adapter_paths: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 16
    max_prompts_per_request: int = 256
    max_chat_messages: int = 1024
    max_pending_requests: int = 1024
    max_tenant_share: float = 0.5
    prompt_threads: int = 2
    max_connections: int = ConnectionLimits.max_connections
    header_timeout: float = ConnectionLimits.header_timeout
    max_header_bytes: int = ConnectionLimits.max_header_bytes
    shutdown_timeout: float = 10.0
    prefix_cache_tenant_salt: bool = True
    max_concurrent_loads: int = 4
    max_loads_per_tenant: int = 1
    adapter_load_timeout: float = 60.0
    stream_send_timeout: float = 30.0
    strict_request_fields: bool = False
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    enable_log_requests: bool = False
    generation_config: str = "auto"
    tool_call_parser: str = "hermes"
    max_logprob_entries: int | None = 1_000_000  # about 65 MiB of JSON
    max_unsent_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        for name in ("max_body_bytes", "max_n", "max_pending_requests", "max_prompts_per_request",
                     "max_chat_messages", "prompt_threads", "max_concurrent_loads", "max_loads_per_tenant",
                     "max_unsent_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_prompt_tokens", "max_tokens_limit", "max_logprob_entries"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.adapter_load_timeout > 0:
            raise ValueError(f"adapter_load_timeout must be > 0, got {self.adapter_load_timeout}")
        if not self.stream_send_timeout > 0:  # NaN refused too
            raise ValueError(f"stream_send_timeout must be a number of seconds > 0, got {self.stream_send_timeout}")
        if not 0 < self.max_tenant_share <= 1:
            raise ValueError(f"max_tenant_share must be in (0, 1], got {self.max_tenant_share}")
        for allowed in self.allowed_adapter_paths:
            if not (os.path.isabs(allowed) and os.path.isdir(allowed)):
                raise ValueError(f"allowed adapter path {allowed!r} must be an absolute path to an existing directory")
        if self.tool_call_parser not in AUTO_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} is not available: this server reads tool "
                             f"calls with {', '.join(AUTO_PARSERS)} (mistral, qwen3_coder / qwen3_xml and the "
                             "others are not implemented)")
        self.connection_limits  # noqa: B018 - validates the connection limits (ValueError)

    @property
    def connection_limits(self) -> ConnectionLimits:
        """The limits uvicorn's connections are served with."""
        return ConnectionLimits(self.max_connections, self.header_timeout, self.max_header_bytes)


class ServerState:
    """Shared by all routes of one app; lives on ``app.state.server``. The engine is used only
    through its EngineClient protocol; the adapters it serves are read from it (``adapter``,
    ``adapters``), never copied here."""

    def __init__(self, engine: EngineClient, config: ServerConfig, keys: KeyRing) -> None:
        self.engine, self.config, self.keys = engine, config, keys
        self.base_name = config.served_model_name  # reserved: no adapter may be served under it
        self.metrics = ServerMetrics(engine, base_name=config.served_model_name)  # labelled with its own series
        self.loads = LoadExecutor(config.max_concurrent_loads, config.max_loads_per_tenant,
                                  config.adapter_load_timeout)
        self.max_model_len = engine.max_model_len
        self.max_prompt_tokens = min(config.max_prompt_tokens or self.max_model_len, self.max_model_len)
        self.max_tokens_limit = min(config.max_tokens_limit or self.max_model_len, self.max_model_len)
        self.max_logprobs = engine.max_logprobs  # checked here too, so an excess is a 400 before any work
        self.sampling_defaults = SamplingDefaults()  # --generation-config's (set by launch.build_state)
        self.draining = False  # set on shutdown: new generations get 503
        self._in_flight = 0
        self.unsent_bytes = 0  # held by finished responses whose seats were given back (hold_unsent)
        self._in_flight_per_tenant: Counter[str] = Counter()
        # one tenant's share of the seats; a server with a single tenant gives it every seat
        share = math.floor(config.max_tenant_share * config.max_pending_requests)
        self.tenant_seats = max(1, share) if keys.num_tenants > 1 else None
        self._prompt_pool = ThreadPoolExecutor(config.prompt_threads, thread_name_prefix="lora-runner-prompts")

    @property
    def tokenizer(self):
        """The model's transformers tokenizer, or None."""
        return self.engine.get_tokenizer()

    def token_text(self, token_id: int) -> str:
        """A token's text for logprobs (special tokens included; "token_id:N" without a tokenizer)."""
        tokenizer = self.tokenizer
        return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id])

    def prompt_text(self, token_ids: list[int]) -> str:
        """The text of a prompt given as token ids (special tokens included, as echo reports it; "" without
        a tokenizer)."""
        tokenizer = self.tokenizer
        return "" if tokenizer is None else tokenizer.decode(token_ids)

    @staticmethod
    def new_id(prefix: str) -> str:
        """A fresh response/request id."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def adapter(self, name: str, tenant: Tenant) -> ServedAdapter | None:
        """The adapter served as ``name`` when it exists and ``tenant`` may use it, else None (the two look
        alike)."""
        served = self.engine.served_adapter(name)
        return served if served is not None and tenant.may_use(name) else None

    def adapters(self, tenant: Tenant) -> list[ServedAdapter]:
        """The served adapters ``tenant`` may see (LoRAs, then soft prompts, each in the order first served)."""
        return [a for a in self.engine.served_adapters() if tenant.may_use(a.name)]

    def serve(self, request: LoRARequest | PromptAdapterRequest, load: bool = True) -> None:
        """Serve a startup adapter, loaded and validated now unless ``load`` is False (then the first
        request for it loads it); AdapterError, ValueError for a taken name."""
        if request.name == self.base_name:
            raise ValueError(f"adapter name {request.name!r} is the base model's served name")
        served = self.engine.serve_adapter(request, load=load)
        self.metrics.label_model(request.name)  # named at start-up: its own latency series
        logger.info("serving %s %r from %s", served.kind, request.name, request.path)

    async def off_loop(self, fn: Callable, *args):
        """``fn(*args)`` on the bounded prompt pool (tokenizing, rendering a chat template), so one
        tenant's big body does not stall the event loop that serves every other tenant's streams."""
        return await asyncio.get_running_loop().run_in_executor(self._prompt_pool, fn, *args)

    def close(self) -> None:
        """Stop the prompt pool (after the engine shut down)."""
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    def admit(self, tenant: Tenant, count: int) -> Callable[[], None]:
        """Take `count` generation seats (sequences: prompts x n); returns the (idempotent) release.
        503 when the engine is down, 429 over the tenant's max_concurrent_requests or its share of
        the seats, 503 when the server is full."""
        if not self.engine.is_running or self.draining:
            raise APIError(503, "the engine is not serving requests (shutting down?)", "engine_unavailable")
        held = self._in_flight_per_tenant[tenant.name]
        limit = tenant.max_concurrent_requests
        if limit is not None and held + count > limit:
            raise APIError(429, f"more than {limit} concurrent requests for this key", "rate_limit_exceeded")
        if self.tenant_seats is not None and held + count > self.tenant_seats:
            raise APIError(429, f"this key holds {held} sequences and asks for {count} more; one key may hold "
                           f"{self.tenant_seats} of the server's {self.config.max_pending_requests} (prompts x n, "
                           "--max-tenant-share); retry when some finish", "tenant_share_exceeded")
        if self._in_flight + count > self.config.max_pending_requests:
            raise APIError(503, "the server is at capacity; retry later", "server_busy")
        self._in_flight += count
        self._in_flight_per_tenant[tenant.name] += count

        def release() -> None:
            self._in_flight -= count
            self._in_flight_per_tenant[tenant.name] -= count

        return _once(release)

    @property
    def in_flight(self) -> int:
        """Generation seats (sequences) held now."""
        return self._in_flight

    def hold_unsent(self, nbytes: int) -> Callable[[], None] | None:
        """Charge `nbytes` of a finished response's unsent output to max_unsent_bytes; the (idempotent)
        refund, or None when it does not fit (the response then keeps its seats)."""
        if self.unsent_bytes + nbytes > self.config.max_unsent_bytes:
            return None
        self.unsent_bytes += nbytes

        def refund() -> None:
            self.unsent_bytes -= nbytes

        return _once(refund)


def _once(undo: Callable[[], None]) -> Callable[[], None]:
    """``undo`` made idempotent: a seat release or a byte refund given back twice counts once."""
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            undo()

    return call
