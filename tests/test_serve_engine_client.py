"""The server's view of the engine is the EngineClient protocol: a stand-in client, no model."""

from adapters.manager import AdapterStats
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.engine.protocol import EngineClient
from lora_runner.engine.stats import EngineStats
from lora_runner.entrypoints.openai.metrics import ServerMetrics
from lora_runner.entrypoints.openai.state import ServerConfig, ServerState
from lora_runner.entrypoints.openai.tenants import KeyRing

STATS = EngineStats(running=2, waiting=5, kv_blocks_used=7, kv_blocks_total=32, preemptions=4, steps=9,
                    adapters=AdapterStats(lora_loads=11, lora_evictions=12, lora_disk_loads=13, lora_cpu_evictions=14,
                                          prompt_loads=15, prompt_evictions=16))


class StandInEngine:
    """Only what the server's state and metrics read; any other use fails loudly."""

    model_name, max_model_len, max_logprobs, is_running = "org/model", 64, 5, True

    def get_stats(self) -> EngineStats:
        return STATS

    def num_in_flight(self) -> int:
        return 3


def test_async_llm_engine_has_every_engine_client_member():
    members = [name for name in dir(EngineClient) if not name.startswith("_")]
    assert {"generate", "encode", "add_lora", "get_stats", "max_logprobs", "shutdown"} <= set(members)
    assert [name for name in members if not hasattr(AsyncLLMEngine, name)] == []


def test_metrics_are_the_engines_stats_snapshot():
    text = ServerMetrics(StandInEngine()).render().decode().splitlines()
    for line in ("lora_runner_requests_running 2.0", "lora_runner_requests_waiting 5.0",
                 "lora_runner_requests_in_flight 3.0", "lora_runner_kv_blocks_used 7.0",
                 "lora_runner_kv_blocks_total 32.0", "lora_runner_preemptions_total 4.0",
                 "lora_runner_engine_up 1.0", "lora_runner_lora_slot_misses_total 11.0",
                 "lora_runner_lora_slot_evictions_total 12.0",
                 'lora_runner_adapter_events_total{event="lora_disk_loads"} 13.0',
                 'lora_runner_adapter_events_total{event="prompt_evictions"} 16.0'):
        assert line in text, line


def test_request_limits_come_from_the_engine():
    config = ServerConfig("base", max_prompt_tokens=1000, max_tokens_limit=32)
    state = ServerState(StandInEngine(), config, KeyRing.from_options([], None))
    assert (state.max_model_len, state.max_prompt_tokens, state.max_tokens_limit) == (64, 64, 32)
    assert state.max_logprobs == 5
