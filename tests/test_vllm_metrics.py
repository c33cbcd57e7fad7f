"""vLLM's metric names beside ours on /metrics: the series a vLLM Grafana dashboard queries exist with
vLLM's labels (model_name, engine), and move with requests by exact counts (the real server, the
official openai client); adapter names in vllm:lora_requests_info follow our label rule."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_support import PROMPTS, model_with_chat_template, serve_args, start_server

from adapters.manager import AdapterStats
from lora_runner.engine.stats import EngineStats
from lora_runner.entrypoints.openai.metrics import ServerMetrics

BASE = {"model_name": "base", "engine": "0"}
# the selectors of vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json), by series
DASHBOARD = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
             "vllm:gpu_cache_usage_perc", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
             "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
             "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
             "vllm:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_sum",
             "vllm:request_queue_time_seconds_bucket", "vllm:request_prefill_time_seconds_bucket",
             "vllm:request_decode_time_seconds_bucket", "vllm:num_preemptions_total",
             "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]


def _series(text: str) -> dict[str, list[tuple[dict, float]]]:
    """sample name -> [(labels, value)]."""
    found: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found


def _query(series, name: str, **labels) -> float:
    """sum(name{labels}), as PromQL's sum over the matching series."""
    want = {**BASE, **labels} if name.startswith("vllm:") and name != "vllm:lora_requests_info" else labels
    return sum(value for got, value in series.get(name, []) if all(got.get(k) == v for k, v in want.items()))


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    model_dir, _, adapters = engine_checkpoint
    model = model_with_chat_template(model_dir, tmp_path_factory.mktemp("vllm-metrics") / "model")
    server, state = start_server(serve_args(model, {"r4": adapters["r4"][0]}))
    yield server, state
    server.stop()


def _scrape(served) -> dict:
    return _series(httpx.get(served[0].base_url + "/metrics").text)


def test_vllm_dashboard_series_exist_and_move_with_requests(served):
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)
    before = _scrape(served)
    for name in DASHBOARD:
        assert any(labels.items() >= BASE.items() for labels, _ in before.get(name, [])), name
    usages = [client.completions.create(model="base", prompt=PROMPTS[0], max_tokens=5, temperature=0.0,
                                        extra_body={"ignore_eos": True}).usage]
    for chunk in client.chat.completions.create(model="r4", messages=[{"role": "user", "content": "hello"}],
                                                max_tokens=5, temperature=0.0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usages.append(chunk.usage)
    after = _scrape(served)

    def moved(name, **labels):
        return _query(after, name, **labels) - _query(before, name, **labels)

    assert moved("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert moved("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 10
    assert moved("vllm:request_success_total", finished_reason="length") == 2
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                      "request_decode_time"):
        assert moved(f"vllm:{histogram}_seconds_count") == 2, histogram
        assert moved(f"vllm:{histogram}_seconds_bucket", le="+Inf") == 2, histogram
    assert moved("vllm:inter_token_latency_seconds_count") >= 1  # the stream's tokens came one by one
    assert _query(after, "vllm:time_per_output_token_seconds_count") == \
        _query(after, "vllm:inter_token_latency_seconds_count")
    # the same counters as ours, summed over our model label
    assert _query(after, "vllm:prompt_tokens_total") == _query(after, "lora_runner_prompt_tokens_total")
    assert _query(after, "vllm:e2e_request_latency_seconds_count") == \
        _query(after, "lora_runner_e2e_request_latency_seconds_count")
    assert 0.0 <= _query(after, "vllm:kv_cache_usage_perc") <= 1.0


def test_lora_requests_info_names_the_running_adapter(served):
    """A long stream on r4: some scrape during it shows r4 running, as vLLM's dashboard reads it."""
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)
    seen = []
    for chunk in client.completions.create(model="r4", prompt=PROMPTS[1], max_tokens=64, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True}):
        info = _scrape(served)["vllm:lora_requests_info"]
        seen.append(info[0][0]["running_lora_adapters"])
        if seen[-1] == "r4":
            break
    assert seen[-1] == "r4", seen
    assert info[0][0]["max_lora"] == "2" and info[0][1] > 1e9  # vLLM's value: a Unix time


class _Engine:
    """The stats snapshot and what the collectors read."""

    is_running, model_name = True, "org/model"

    def __init__(self, **stats) -> None:
        adapters = AdapterStats(**{f.name: 0 for f in dataclasses.fields(AdapterStats)})
        self.stats = EngineStats(running=3, waiting=4, kv_blocks_used=6, kv_blocks_total=8, preemptions=0,
                                 steps=1, adapters=adapters, **stats)

    def get_stats(self):
        return self.stats

    def num_in_flight(self):
        return 0


def test_lora_info_and_reasons_follow_our_label_rule():
    """Start-up names keep their name, runtime adapters are "other"; tool calls finish as vLLM's "stop"."""
    metrics = ServerMetrics(_Engine(running_loras=("r4", "tenant-a", "tenant-b"), waiting_loras=("sql",),
                                    max_loras=4), "base")
    metrics.label_model("r4")
    metrics.label_model("sql")
    metrics.finished.labels("tool_calls").inc()
    metrics.finished.labels("stop").inc(2)
    series = _series(metrics.render().decode())
    (labels, _), = series["vllm:lora_requests_info"]
    assert labels == {"max_lora": "4", "running_lora_adapters": "other,r4", "waiting_lora_adapters": "sql"}
    assert _query(series, "vllm:request_success_total", finished_reason="stop") == 3
    assert _query(series, "vllm:num_requests_running") == 3 and _query(series, "vllm:num_requests_waiting") == 4
    assert _query(series, "vllm:kv_cache_usage_perc") == 0.75
    assert _query(series, "vllm:time_to_first_token_seconds_count") == 0  # an empty histogram is still a series
