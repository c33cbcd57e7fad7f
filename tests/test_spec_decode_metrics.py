"""Speculative decoding's counters on /metrics: vLLM's names for the engine (verify steps, draft
tokens, accepted tokens, accepted per position) and ours per served model, by the label rule of the
latency histograms (the base model and start-up adapters by name, every other adapter "other")."""

from __future__ import annotations

import dataclasses
import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.manager import AdapterStats
from lora_runner.engine.stats import EngineStats
from lora_runner.entrypoints.openai.metrics import ServerMetrics
from lora_runner.outputs import SpecDecodingStats
from serve_support import serve_args, start_server

OPERATOR = "operator-key-0000"  # /metrics is the operator's
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "min_acceptance_rate": 0}
NO_EVENTS = AdapterStats(0, 0, 0, 0, 0, 0)
PROMPT = [7, 8, 9, 10] * 6  # repeats: the n-gram proposes from it


def _samples(text: str) -> dict[tuple, float]:
    """(sample name, sorted labels) -> value of a Prometheus exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _by_model(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["model"]: value for (sample, labels), value in samples.items()
            if sample == name and "position" not in dict(labels)}


@pytest.fixture(scope="module")
def served(engine_checkpoint):
    path, _, adapters = engine_checkpoint
    server, state = start_server(serve_args(path, {"r4": adapters["r4"][0]}, extra=[
        "--api-key", OPERATOR, "--speculative-config", json.dumps(SPEC)]))
    yield server, state
    server.stop()


def test_metrics_count_drafts_for_the_engine_and_per_served_model(served):
    server, state = served
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=OPERATOR, max_retries=0)
    for model in ("base", "r4", "r4"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0)
    refused = httpx.get(server.base_url + "/metrics")
    assert refused.status_code == 401
    samples = _samples(httpx.get(server.base_url + "/metrics", headers={"Authorization": f"Bearer {OPERATOR}"}).text)
    stats = state.engine.get_stats()
    spec, by_adapter = stats.spec_decode, stats.spec_decode_by_adapter
    assert spec.num_drafts > 0 and spec.num_accepted_tokens > 0
    base = (("engine", "0"), ("model_name", "base"))
    assert samples[("vllm:spec_decode_num_drafts_total", base)] == spec.num_drafts
    assert samples[("vllm:spec_decode_num_draft_tokens_total", base)] == spec.num_draft_tokens
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", base)] == spec.num_accepted_tokens
    for position, accepted in enumerate(spec.accepted_per_position):
        key = ("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*base, ("position", str(position))))
        assert samples[key] == accepted
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        ours = _by_model(samples, f"lora_runner_spec_decode_{name}_total")
        assert ours == {label: getattr(by_adapter[adapter], name) for label, adapter in (("base", None), ("r4", "r4"))
                        if adapter in by_adapter}, name
        assert sum(ours.values()) == getattr(spec, name)
    assert by_adapter["r4"].num_drafts > 0


class _Engine:
    """An EngineClient whose stats hold speculation counts of the base model and three adapters."""

    def __init__(self) -> None:
        def counts(drafts: int, accepted: list[int]) -> SpecDecodingStats:
            return SpecDecodingStats(2, drafts, 2 * drafts, sum(accepted), accepted)
        self.by_adapter = {None: counts(4, [3, 1]), "named": counts(2, [1, 0]), "x": counts(3, [2, 2]),
                           "y": counts(1, [1, 1])}

    def get_stats(self) -> EngineStats:
        total = SpecDecodingStats(2, 10, 20, 11, [7, 4])
        return EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=1, preemptions=0, steps=1,
                           adapters=NO_EVENTS, spec_decode=total, spec_decode_by_adapter=self.by_adapter)

    def num_in_flight(self) -> int:
        return 0

    is_running = True


def test_adapters_not_named_at_start_up_are_summed_as_other():
    metrics = ServerMetrics(_Engine(), "base")
    metrics.label_model("named")
    samples = _samples(metrics.render().decode())
    assert _by_model(samples, "lora_runner_spec_decode_num_drafts_total") == {"base": 4, "named": 2, "other": 4}
    per_position = {(dict(labels)["model"], dict(labels)["position"]): value for (name, labels), value in samples.items()
                    if name == "lora_runner_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_position[("other", "0")] == 3 and per_position[("other", "1")] == 3
    assert per_position[("base", "0")] == 3


def test_no_speculation_no_series():
    class Off(_Engine):
        def get_stats(self) -> EngineStats:
            return EngineStats(running=0, waiting=0, kv_blocks_used=0, kv_blocks_total=1, preemptions=0, steps=1,
                               adapters=NO_EVENTS)
    text = ServerMetrics(Off(), "base").render().decode()
    assert "spec_decode" not in text


def test_draft_model_forwards_on_metrics():
    """The draft model's forwards and computed tokens are counters of their own, read through the policy."""
    from types import SimpleNamespace

    from lora_runner.core.block_manager import BlockManager
    from lora_runner.spec_decode.adaptive import SpeculationPolicy
    from lora_runner.spec_decode.config import SpeculativeConfig

    config = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2})
    draft = SimpleNamespace(num_speculative_tokens=2, num_forwards=7, num_computed_tokens=45)
    scheduler = SimpleNamespace(running=[], waiting=[], num_preemptions=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                                max_loras=0, speculator=SpeculationPolicy(draft, config),
                                spec=SpecDecodingStats(2), spec_by_adapter={})
    stats = EngineStats.collect(scheduler, BlockManager(4, 4), steps=1)
    assert (stats.draft_forwards, stats.draft_computed_tokens) == (7, 45)

    class Drafting(_Engine):
        def get_stats(self) -> EngineStats:
            return dataclasses.replace(super().get_stats(), draft_forwards=7, draft_computed_tokens=45)
    text = ServerMetrics(Drafting(), "base").render().decode()
    names = [family.name for family in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)), "a metric family exposed twice"
    samples = _samples(text)
    assert samples[("lora_runner_spec_decode_draft_forwards_total", ())] == 7
    assert samples[("lora_runner_spec_decode_draft_computed_tokens_total", ())] == 45
    # n-gram proposals run no draft model: no such series
    assert "draft_forwards" not in ServerMetrics(_Engine(), "base").render().decode()
