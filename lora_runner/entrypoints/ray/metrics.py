"""The ingress's ``/metrics`` on Ray Serve: generation requests and adapter loads, per replica and summed,
and vLLM's ``vllm:*`` series of every replica.

Built at scrape time from the ingress's request counts and the latest report of each engine
replica (lora_runner.entrypoints.ray.replica.EngineReplicaBase.report). A replica's ``vllm:*`` series are
the single-process server's (VllmCollector, read from the replica's own ServerMetrics when it answers:
``vllm_series``); the ingress labels each replica's with ``engine`` = the replica's id, as vLLM labels the
engines of one server, so a vLLM dashboard sums or splits them as it does vLLM's. Reading them costs
a replica ~2 ms and ~11 KB, so a report carries them at most once a second (``VllmSeries``) and the ingress
keeps the latest it got: like the adapter counts they are as of the replica's latest answer (its head, sent
before that request's own tokens), and at most VLLM_SERIES_INTERVAL_S older than it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from lora_runner.entrypoints.openai.vllm_metrics import VllmCollector

# (family name, type, help, samples [(sample name, labels, value)]): a vLLM family as a replica reports it
VllmFamily = tuple[str, str, str, list[tuple[str, dict[str, str], float]]]
VLLM_SERIES_INTERVAL_S = 1.0  # a replica's reports carry its vllm:* series at most this often


class VllmSeries:
    """What a replica's report adds for the ingress's vllm:* series: ``{"vllm": vllm_series(metrics)}`` when
    the last one is `interval_s` old (the first report always), else nothing (the ingress keeps the last)."""

    def __init__(self, metrics, interval_s: float = VLLM_SERIES_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics, self.interval_s, self.clock = metrics, interval_s, clock
        self.read_at: float | None = None

    def report(self) -> dict:
        """``{"vllm": [...]}`` when due, else ``{}``."""
        now = self.clock()
        if self.read_at is not None and now - self.read_at < self.interval_s:
            return {}
        self.read_at = now
        return {"vllm": vllm_series(self.metrics)}


def vllm_series(metrics) -> list[VllmFamily]:
    """The ``vllm:*`` series of a replica's ServerMetrics `metrics` (what its own /metrics shows), as plain
    tuples for its report (they travel to the ingress pickled)."""
    return [(family.name, family.type, family.documentation,
             [(sample.name, dict(sample.labels), sample.value) for sample in family.samples])
            for family in VllmCollector(metrics, metrics.base_name).collect()]


def render_metrics(requests: Counter, reports: dict[str, dict]) -> bytes:
    """Prometheus text: generation requests and adapter loads/evictions, per replica and summed."""
    registry = CollectorRegistry()
    registry.register(_ReplicaCollector(requests, reports))
    return generate_latest(registry)


class _ReplicaCollector:
    """The replicas' counters, read when the registry is rendered."""

    def __init__(self, requests: Counter, reports: dict[str, dict]) -> None:
        self.requests, self.reports = requests, reports

    def collect(self):
        """Yield the request counters, the adapter load/eviction counters and the resident gauge."""
        per_model = CounterMetricFamily("lora_runner_requests", "Generation requests, per served model "
                                        "(all replicas)", labels=["model"])
        for model, count in _sum_by(self.requests, 1).items():
            per_model.add_metric([model], count)
        yield per_model
        per_replica = CounterMetricFamily("lora_runner_replica_requests", "Generation requests per replica",
                                          labels=["replica"])
        for replica, count in _sum_by(self.requests, 0).items():
            per_replica.add_metric([replica], count)
        yield per_replica
        for kind in ("loads", "unloads"):
            yield from self._adapter_counters(kind)
        resident = GaugeMetricFamily("lora_runner_replica_adapters_resident", "1 for each LoRA in a replica's "
                                     "engine cache (as of the replica's latest answer)", labels=["replica", "adapter"])
        for replica, report in sorted(self.reports.items()):
            for adapter in report["resident"]:
                resident.add_metric([replica, adapter], 1)
        yield resident
        yield from self._vllm_families()

    def _adapter_counters(self, kind: str):
        verb = "registered with" if kind == "loads" else "evicted from"
        total = sum(sum(r[kind].values()) for r in self.reports.values())
        yield CounterMetricFamily(f"lora_runner_adapter_{kind}", f"Adapters {verb} a replica's engine "
                                  "(all replicas)", value=total)
        per = CounterMetricFamily(f"lora_runner_replica_adapter_{kind}", f"Adapters {verb} the replica's "
                                  "engine, per replica and adapter", labels=["replica", "adapter"])
        for replica, report in sorted(self.reports.items()):
            for adapter, count in sorted(report[kind].items()):
                per.add_metric([replica, adapter], count)
        yield per

    def _vllm_families(self):
        """Every replica's vLLM families, one family per name, each replica's series labelled engine=<replica>."""
        families: dict[str, Metric] = {}
        for replica, report in sorted(self.reports.items()):
            for name, kind, documentation, samples in report.get("vllm", ()):
                family = families.setdefault(name, Metric(name, documentation, kind))
                for sample_name, labels, value in samples:
                    family.add_sample(sample_name, {**labels, "engine": replica}, value)
        yield from families.values()

    def describe(self):
        """Nothing up front: the labels are only known at collect time."""
        return []


def _sum_by(counter: Counter, position: int) -> Counter:
    sums: Counter = Counter()
    for key, count in counter.items():
        sums[key[position]] += count
    return sums
