"""vLLM's metric names beside ours on /metrics, so a dashboard built for vLLM works unchanged.

Nothing is counted twice: at scrape time the ``vllm:*`` series are read from the server's own
``lora_runner_*`` metrics (ServerMetrics) and the engine's stats snapshot, and carry vLLM's labels
``model_name`` (the base model's served name: vLLM counts its LoRA requests under it too) and
``engine`` ("0"). Our histograms' ``model`` series are summed into one per bucket. Adapter names
appear only in ``vllm:lora_requests_info``, under our label rule (served names of the base model and
start-up adapters; "other" for runtime ones). With speculative decoding on, the engine's
``vllm:spec_decode_*`` counters (labelled ``model_name`` only, ``position`` for the last) are read
from its stats snapshot here too; their per-adapter twins are ServerMetrics'.
"""

from __future__ import annotations

import time
from collections import defaultdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LABELS = ["model_name", "engine"]
# vLLM's finished_reason of ours (a tool call ends with the engine's "stop")
_FINISHED_REASON = {"tool_calls": "stop"}

# vLLM's name -> (the ServerMetrics histogram attribute it reads, its help); time_per_output_token is
# vLLM's older name of inter_token_latency, still queried by its Grafana dashboard
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("ttft", "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("itl", "Histogram of inter-token latency in seconds."),
    "vllm:time_per_output_token_seconds": ("itl", "Histogram of time per output token in seconds (older name "
                                                  "of vllm:inter_token_latency_seconds)."),
    "vllm:e2e_request_latency_seconds": ("e2e", "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("queue_time", "Histogram of time spent in WAITING phase for request."),
    "vllm:request_prefill_time_seconds": ("prefill_time", "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("decode_time", "Histogram of time spent in DECODE phase for request."),
}
# speculative decoding's counters: (SpecDecodingStats field, help); ServerMetrics' per-adapter
# lora_runner_spec_decode_* series reuse them
SPEC_COUNTERS = (("num_drafts", "Verify steps of speculative decoding (sequences that verified drafts, per step)"),
                 ("num_draft_tokens", "Draft tokens verified"),
                 ("num_accepted_tokens", "Draft tokens accepted"))
SPEC_PER_POSITION_DOC = "Draft tokens accepted at each draft position (0: the first draft)"


class VllmCollector:
    """The ``vllm:*`` series of one server (see the module docstring); registered by ServerMetrics.

    metrics: the ServerMetrics whose counters and histograms are read; model_name: the label value.
    """

    def __init__(self, metrics, model_name: str) -> None:
        self.metrics, self.labels = metrics, [model_name, "0"]

    def collect(self):
        """Yield the vLLM-named gauges, counters and histograms."""
        stats = self.metrics.engine.get_stats()
        usage = stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
        for name, doc, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
                ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (older name of "
                                              "vllm:kv_cache_usage_perc).", usage)):
            yield self._one(GaugeMetricFamily(name, doc, labels=LABELS), value)
        for name, doc, value in (
                ("vllm:prompt_tokens", "Number of prefill tokens processed.", _total(self.metrics.prompt_tokens)),
                ("vllm:generation_tokens", "Number of generation tokens processed.",
                 _total(self.metrics.generation_tokens)),
                ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.preemptions),
                ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                 stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                 stats.prefix_cache_hits)):
            yield self._one(CounterMetricFamily(name, doc, labels=LABELS), value)
        yield self._successes()
        for name, (attribute, doc) in HISTOGRAMS.items():
            buckets, total = _summed_histogram(getattr(self.metrics, attribute))
            family = HistogramMetricFamily(name, doc, labels=LABELS)
            family.add_metric(self.labels, buckets, total)
            yield family
        yield self._lora_info(stats)
        if stats.spec_decode is not None:
            yield from self._spec_decode(stats.spec_decode)

    def describe(self):
        """Nothing up front (as ServerMetrics' engine collector)."""
        return []

    def _one(self, family, value):
        family.add_metric(self.labels, value)
        return family

    def _successes(self) -> CounterMetricFamily:
        family = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                     labels=[*LABELS, "finished_reason"])
        counts: dict[str, float] = defaultdict(float)
        for sample in _samples(self.metrics.finished, "_total"):
            reason = sample.labels["reason"]
            counts[_FINISHED_REASON.get(reason, reason)] += sample.value
        for reason, value in sorted(counts.items()):
            family.add_metric([*self.labels, reason], value)
        return family

    def _lora_info(self, stats) -> GaugeMetricFamily:
        """vLLM's lora_requests_info: the running and waiting adapters as comma-joined labels, its value
        the scrape's time (vLLM sets it to the time of its latest stats)."""
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])

        def joined(names) -> str:
            return ",".join(sorted({self.metrics.model_label(name) for name in names}))

        family.add_metric([str(stats.max_loras), joined(stats.waiting_loras), joined(stats.running_loras)],
                          time.time())
        return family


    def _spec_decode(self, spec):
        """vLLM's speculative-decoding counters of the engine, labelled as every vllm:* series (and
        ``position`` for the accepted tokens per draft position)."""
        for name, doc in SPEC_COUNTERS:
            family = CounterMetricFamily(f"vllm:spec_decode_{name}", doc, labels=LABELS)
            family.add_metric(self.labels, getattr(spec, name))
            yield family
        family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", SPEC_PER_POSITION_DOC,
                                     labels=[*LABELS, "position"])
        for position, accepted in enumerate(spec.accepted_per_position):
            family.add_metric([*self.labels, str(position)], accepted)
        yield family


def _samples(metric, suffix: str):
    """The samples of a prometheus_client metric whose names end with `suffix`."""
    return [sample for family in metric.collect() for sample in family.samples if sample.name.endswith(suffix)]


def _total(counter) -> float:
    return sum(sample.value for sample in _samples(counter, "_total"))


def _summed_histogram(histogram) -> tuple[list[tuple[str, float]], float]:
    """(cumulative buckets [(le, count)], sum) of a labelled histogram, its series summed."""
    buckets: dict[str, float] = defaultdict(float)
    for sample in _samples(histogram, "_bucket"):
        buckets[sample.labels["le"]] += sample.value
    total = sum(sample.value for sample in _samples(histogram, "_sum"))
    if not buckets:  # no series yet: the one bucket every histogram has
        buckets["+Inf"] = 0.0
    return sorted(buckets.items(), key=lambda item: float(item[0])), total
