"""Latency metrics dashboards expect (vLLM's names after our prefix): e2e, queue, prefill and decode
time from the engine's RequestTimes, TTFT and inter-token latency from the server, per model where
the label set is bounded (base + start-up adapters; runtime loads are "other"). Assertions are on
counts and the order of events, never on speed."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from engine_support import make_engine, run_to_completion
from prometheus_client.parser import text_string_to_metric_families
from serve_support import serve_args, start_server

from adapters.manager import AdapterStats
from lora_runner import SamplingParams
from lora_runner.engine.stats import EngineStats
from lora_runner.entrypoints.openai.metrics import ServerMetrics
from lora_runner.request_times import RequestTimes

HISTOGRAMS = ["e2e_request_latency", "request_queue_time", "request_prefill_time", "request_decode_time",
              "time_to_first_token", "inter_token_latency"]


def test_engine_outputs_carry_request_times_in_the_order_of_events(engine_checkpoint):
    model_dir = engine_checkpoint[0]
    engine = make_engine(model_dir, max_num_seqs=1)  # one at a time: the second one queues
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        done = run_to_completion(engine, [("first", [1, 2, 3], params), ("second", [4, 5, 6], params)])
    finally:
        engine.close()
    first, second = done["first"].metrics, done["second"].metrics
    for times in (first, second):
        assert times.arrival <= times.first_scheduled <= times.first_token <= times.last_token <= times.finished
        assert times.queue_time >= 0 and times.prefill_time >= 0 and times.decode_time >= 0
    assert second.first_scheduled >= first.last_token  # it waited for the only seat


def test_a_preempted_request_keeps_its_first_scheduling_time():
    times = RequestTimes(arrival=1.0)
    times.scheduled(2.0)
    times.tokens(1, 3.0)
    times.scheduled(5.0)  # readmitted after a preemption
    times.tokens(2, 6.0)
    assert (times.queue_time, times.prefill_time, times.decode_time) == (1.0, 1.0, 3.0)
    assert RequestTimes(arrival=1.0).queue_time is None and RequestTimes().decode_time is None


class _IdleEngine:
    is_running, model_name = True, "org/model"

    def get_stats(self):
        adapters = AdapterStats(**{f.name: 0 for f in dataclasses.fields(AdapterStats)})
        return EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=8, preemptions=3, steps=1,
                           adapters=adapters)

    def num_in_flight(self):
        return 0


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_only_start_up_names_get_their_own_series_others_are_other():
    metrics = ServerMetrics(_IdleEngine())
    metrics.label_model("base")
    metrics.label_model("r4")
    times = RequestTimes(arrival=0.0, first_scheduled=0.5, first_token=1.0, last_token=2.0, finished=2.0)
    for name in ["base", "r4", "runtime-1", "runtime-2", "runtime-3"]:
        metrics.request_finished(name, 2.5, times)
    metrics.request_finished("base", 1.0, None)  # n > 1: e2e only
    samples = _samples(metrics.render().decode())
    e2e = {dict(labels)["model"]: v for (name, labels), v in samples.items()
           if name == "lora_runner_e2e_request_latency_seconds_count"}
    assert e2e == {"base": 2.0, "r4": 1.0, "other": 3.0}
    queue = samples[("lora_runner_request_queue_time_seconds_sum", (("model", "other"),))]
    assert queue == pytest.approx(1.5)
    assert samples[("lora_runner_request_decode_time_seconds_count", (("model", "base"),))] == 1.0
    assert samples[("lora_runner_preemptions_total", ())] == 3.0


@pytest.fixture(scope="module")
def served(engine_checkpoint):
    model_dir, _, adapters = engine_checkpoint
    server, state = start_server(serve_args(model_dir, {"r4": adapters["r4"][0]}))
    yield server, state
    server.stop()


def test_the_server_observes_every_histogram_per_model(served):
    client = openai.OpenAI(base_url=served[0].base_url + "/v1", api_key="none", max_retries=0)
    client.completions.create(model="base", prompt="hello world", max_tokens=4, temperature=0.0)
    for _ in client.completions.create(model="r4", prompt="the cat sat", max_tokens=4, temperature=0.0,
                                       stream=True, extra_body={"ignore_eos": True}):
        pass
    samples = _samples(httpx.get(served[0].base_url + "/metrics").text)
    for histogram in HISTOGRAMS:
        for model in ("base", "r4"):
            count = samples.get((f"lora_runner_{histogram}_seconds_count", (("model", model),)), 0.0)
            if histogram == "inter_token_latency" and model == "base":
                continue  # a non-streamed request may get its tokens in one output
            assert count >= 1, (histogram, model)
    assert samples[("lora_runner_e2e_request_latency_seconds_count", (("model", "r4"),))] == 1.0
