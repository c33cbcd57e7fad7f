"""Prometheus metrics of one server (its own CollectorRegistry, so several apps can share a process).

Counted by the HTTP layer: requests per served model, prompt and generated tokens, runtime adapter
loads, and the latency histograms dashboards built for vLLM expect (vLLM's names after our prefix):
time to first token and inter-token latency (measured by the server, from the request's receipt),
end-to-end latency (receipt to the last output), and queue, prefill and decode time (from the
engine's RequestTimes: arrival to first scheduling, to first token, to last token). The latency
histograms are labelled by ``model`` only where that set is bounded: the base model and the adapters
named at start-up keep their names, every other adapter (runtime loads) is "other".
Read at scrape time from the stats snapshot
the engine publishes after each step (EngineClient.get_stats): running and waiting requests, KV
blocks in use and cached, preemptions, prefix-cache queries and hits (tokens), and every field of
the adapter manager's cumulative stats (slot loads are the slot misses; hits appear when the
manager counts them). vLLM's names of the same numbers (``vllm:*``) are read from these at scrape time
(lora_runner.entrypoints.openai.vllm_metrics). With speculative decoding on: vLLM's counters of verify
steps, draft tokens, accepted tokens and accepted tokens per draft position (``vllm:spec_decode_*``,
built there, labelled ``model_name`` = the base model's served name, ``position`` for the last), and
here the same per adapter (``lora_runner_spec_decode_*``, labelled ``model`` by the latency histograms'
rule) and the draft model's forwards and computed tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from adapters.manager import AdapterStats
from lora_runner.engine.protocol import EngineClient
from lora_runner.entrypoints.openai.vllm_metrics import SPEC_COUNTERS, SPEC_PER_POSITION_DOC, VllmCollector
from lora_runner.engine.stats import EngineStats
from lora_runner.request_times import RequestTimes

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OTHER_MODEL = "other"  # the latency label of adapters not named at start-up


class ServerMetrics:
    """The server's metrics; ``render()`` gives the Prometheus text format.

    model_name: the base model's served name (its own latency series, and vLLM's ``model_name`` label);
    None: the engine's model_name.
    """

    def __init__(self, engine: EngineClient, model_name: str | None = None) -> None:
        self.engine = engine
        self.base_name = engine.model_name if model_name is None else model_name  # its requests' label
        self.registry = CollectorRegistry()
        reg = self.registry
        self.requests = Counter("lora_runner_requests", "Generation requests accepted, per served model",
                                ["model"], registry=reg)
        self.finished = Counter("lora_runner_requests_finished", "Requests finished, per finish reason",
                                ["reason"], registry=reg)
        self.prompt_tokens = Counter("lora_runner_prompt_tokens", "Prompt tokens of accepted requests", registry=reg)
        self.generation_tokens = Counter("lora_runner_generation_tokens", "Tokens generated", registry=reg)
        self.ttft = Histogram("lora_runner_time_to_first_token_seconds", "Request receipt to first token",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.itl = Histogram("lora_runner_inter_token_latency_seconds", "Time between a request's tokens",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=reg)
        self.e2e = Histogram("lora_runner_e2e_request_latency_seconds", "Request receipt to its last output",
                             ["model"], buckets=_REQUEST_BUCKETS, registry=reg)
        self.queue_time = Histogram("lora_runner_request_queue_time_seconds", "Engine arrival to first "
                                    "scheduling (waiting for room or an adapter)", ["model"],
                                    buckets=_REQUEST_BUCKETS, registry=reg)
        self.prefill_time = Histogram("lora_runner_request_prefill_time_seconds", "First scheduling to first "
                                      "token", ["model"], buckets=_REQUEST_BUCKETS, registry=reg)
        self.decode_time = Histogram("lora_runner_request_decode_time_seconds", "First token to last token",
                                     ["model"], buckets=_REQUEST_BUCKETS, registry=reg)
        self._labelled: set[str] = set()  # the bounded set of model label values (model_label)
        self.runtime_loads = Counter("lora_runner_runtime_adapter_loads", "load_lora_adapter calls, per result",
                                     ["result"], registry=reg)
        self.label_model(self.base_name)
        reg.register(_EngineCollector(engine, self.adapter_label))
        reg.register(VllmCollector(self, self.base_name))

    def label_model(self, name: str) -> None:
        """Give `name` (the base model or an adapter named at start-up) its own latency series."""
        self._labelled.add(name)

    def model_label(self, name: str) -> str:
        """`name` when it has its own series, else "other" (keeps the label set bounded)."""
        return name if name in self._labelled else OTHER_MODEL

    def adapter_label(self, adapter: str | None) -> str:
        """The label of an engine-side adapter name (None: the base model, under its served name)."""
        return self.model_label(self.base_name if adapter is None else adapter)

    def request_finished(self, model: str, seconds_since_receipt: float, times: RequestTimes | None) -> None:
        """Observe a finished request's end-to-end latency and, when the engine reported its
        timestamps, its queue, prefill and decode time."""
        label = self.model_label(model)
        self.e2e.labels(label).observe(seconds_since_receipt)
        if times is None:  # n > 1: the samples' outputs are merged without timestamps
            return
        for histogram, value in ((self.queue_time, times.queue_time), (self.prefill_time, times.prefill_time),
                                 (self.decode_time, times.decode_time)):
            if value is not None:
                histogram.labels(label).observe(value)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state read at scrape time from the engine's stats snapshot (EngineClient.get_stats)."""

    def __init__(self, engine: EngineClient, adapter_label: Callable[[str | None], str]) -> None:
        self.engine = engine
        self.adapter_label = adapter_label

    def collect(self):
        """Yield the engine's gauges and adapter counters."""
        stats = self.engine.get_stats()
        gauges = {
            "lora_runner_requests_running": ("Requests being decoded or prefilled", stats.running),
            "lora_runner_requests_waiting": ("Requests queued (adapter loading or no room)", stats.waiting),
            "lora_runner_requests_in_flight": ("Requests with an open HTTP generation", self.engine.num_in_flight()),
            "lora_runner_kv_blocks_used": ("KV-cache blocks held by requests", stats.kv_blocks_used),
            "lora_runner_kv_blocks_total": ("KV-cache blocks", stats.kv_blocks_total),
            "lora_runner_kv_blocks_cached": ("KV-cache blocks holding a cached prefix (in use or evictable)",
                                             stats.kv_blocks_cached),
            "lora_runner_engine_up": ("1 while the step thread serves requests", int(self.engine.is_running)),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily("lora_runner_preemptions", "Running requests preempted (blocks freed, "
                                  "recomputed later)", value=stats.preemptions)
        yield CounterMetricFamily("lora_runner_prefix_cache_queries", "Prompt tokens of admitted requests "
                                  "looked up in the prefix cache", value=stats.prefix_cache_queries)
        yield CounterMetricFamily("lora_runner_prefix_cache_hits", "Looked-up tokens found computed in the "
                                  "prefix cache", value=stats.prefix_cache_hits)
        yield from self._adapter_stats(stats.adapters)
        if stats.spec_decode is not None:
            yield from _spec_decode_series(stats, self.adapter_label)

    @staticmethod
    def _adapter_stats(stats: AdapterStats):
        events = CounterMetricFamily("lora_runner_adapter_events", "Cumulative adapter-manager events "
                                     "(lora_loads = LoRA slot misses, lora_evictions = slot evictions, "
                                     "lora_disk_loads = adapter loads from disk or the Hub)", labels=["event"])
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            if isinstance(value, (int, float)) and not field.metadata.get("gauge"):
                events.add_metric([field.name], value)
        yield events
        yield GaugeMetricFamily("lora_runner_cpu_lora_cache_bytes", "Bytes the LoRAs in the CPU cache hold "
                                "(bounded by max_cpu_lora_bytes)", value=stats.lora_cpu_cache_bytes)
        yield GaugeMetricFamily("lora_runner_memory_adapter_bytes", "Bytes the snapshots of LoRAs handed over in "
                                "memory hold (bounded by max_memory_adapter_bytes)", value=stats.memory_adapter_bytes)
        yield CounterMetricFamily("lora_runner_lora_slot_misses", "LoRAs written into a device slot",
                                  value=stats.lora_loads)
        yield CounterMetricFamily("lora_runner_lora_slot_evictions", "Resident LoRAs evicted from a slot",
                                  value=stats.lora_evictions)
        hits = getattr(stats, "lora_hits", None)
        if hits is not None:
            yield CounterMetricFamily("lora_runner_lora_slot_hits", "Steps that found a LoRA resident", value=hits)

    def describe(self):
        """Nothing up front: the metric names are only known at collect time."""
        return []


def _spec_decode_series(stats: EngineStats, adapter_label: Callable[[str | None], str]):
    """Speculative decoding's counters per adapter label (adapters that share a label, "other", are
    summed) and the draft model's cost; vLLM's names of the engine's totals are VllmCollector's."""
    positions = len(stats.spec_decode.accepted_per_position)
    per_label: dict[str, list] = {}  # label -> [num_drafts, num_draft_tokens, num_accepted_tokens, per position]
    for adapter, counts in stats.spec_decode_by_adapter.items():
        total = per_label.setdefault(adapter_label(adapter), [0, 0, 0, [0] * positions])
        for i, (name, _) in enumerate(SPEC_COUNTERS):
            total[i] += getattr(counts, name)
        for position, accepted in enumerate(counts.accepted_per_position[:positions]):
            total[3][position] += accepted
    for i, (name, doc) in enumerate(SPEC_COUNTERS):
        ours = CounterMetricFamily(f"lora_runner_spec_decode_{name}", f"{doc}, per served model", labels=["model"])
        for label, total in per_label.items():
            ours.add_metric([label], total[i])
        yield ours
    ours = CounterMetricFamily("lora_runner_spec_decode_num_accepted_tokens_per_pos",
                               f"{SPEC_PER_POSITION_DOC}, per served model", labels=["model", "position"])
    for label, total in per_label.items():
        for position, accepted in enumerate(total[3]):
            ours.add_metric([label, str(position)], accepted)
    yield ours
    if stats.draft_forwards is not None:  # the "draft_model" method: what its proposals cost
        yield CounterMetricFamily("lora_runner_spec_decode_draft_forwards", "Forward passes of the draft model",
                                  value=stats.draft_forwards)
        yield CounterMetricFamily("lora_runner_spec_decode_draft_computed_tokens",
                                  "Tokens the draft model's forward passes computed", value=stats.draft_computed_tokens)
