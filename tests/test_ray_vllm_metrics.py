"""The Ray ingress's /metrics offers vLLM's ``vllm:*`` names beside ours (issue 38 item 6), as the
single-process server does: every family the server's own /metrics has, read from each replica's real report
(EngineReplicaBase.report over a real ServerState), labelled engine=<replica>, values equal to the replica's.
The ingress runs on a stand-in replica handle, without a Ray cluster."""

import asyncio
import json

import httpx
import pytest
from serve_support import serve_args, start_server

pytest.importorskip("ray.serve")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from lora_runner.entrypoints.launch import StartupAdapters  # noqa: E402
from lora_runner.entrypoints.openai.state import ServerConfig  # noqa: E402
from test_ray_ingress_labels import ReplicaStream  # noqa: E402

OPERATOR = "operator-key-0000"


def _vllm(text: str) -> dict[str, dict[tuple, float]]:
    """family name -> {(sample name, sorted labels): value} of the vllm:* families of a /metrics text."""
    return {family.name: {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
            for family in text_string_to_metric_families(text) if family.name.startswith("vllm:")}


@pytest.fixture(scope="module")
def replica_server(engine_checkpoint):
    """(server, state): the single-process app a replica runs, after one completion."""
    server, state = start_server(serve_args(engine_checkpoint[0], {}))
    answer = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                        json={"model": "base", "prompt": "hello there", "max_tokens": 3, "temperature": 0})
    assert answer.status_code == 200, answer.text
    yield server, state
    server.stop()


class _Replicas:
    """The engine deployment's handle: each request answered by the next replica, whose head is its report."""

    def __init__(self, replicas) -> None:
        self.replicas, self.turn, self.handle = replicas, 0, self

    def options(self, **kwargs):
        return self

    def remote(self, method, path, headers, body):
        replica = self.replicas[self.turn % len(self.replicas)]
        self.turn += 1
        return ReplicaStream({"status": 200, "headers": [("content-type", "application/json")], **replica.report()})


def _replica(state, name: str, clock):
    """An EngineReplicaBase over `state` without Serve (its report is the real one), its time `clock`."""
    from lora_runner.entrypoints.ray.metrics import VllmSeries
    from lora_runner.entrypoints.ray.replica import EngineReplicaBase

    replica = object.__new__(EngineReplicaBase)
    replica.state, replica.replica, replica.loads, replica.unloads = state, name, {}, {}
    replica.vllm = VllmSeries(state.metrics, clock=clock)
    return replica


def _request(method: str, path: str, body: bytes = b""):
    from starlette.requests import Request

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"authorization", f"Bearer {OPERATOR}".encode()), (b"content-type", b"application/json")]}
    return Request(scope, receive)


def test_the_ingress_offers_every_replicas_vllm_series(replica_server):
    from lora_runner.entrypoints.ray.ingress import Ingress

    _, state = replica_server
    now = [0.0]
    replicas = _Replicas([_replica(state, "r0", lambda: now[0]), _replica(state, "r1", lambda: now[0])])
    ingress = Ingress(replicas, ServerConfig("base", api_keys=(OPERATOR,)), StartupAdapters())
    body = json.dumps({"model": "base", "prompt": "hi"}).encode()
    for _ in range(3):  # r0, r1, r0: r0's second report, within the second, has no series and keeps its first
        asyncio.run(ingress.generate(_request("POST", "/v1/completions", body)))
    assert "vllm" not in replicas.replicas[0].report() and "vllm" in ingress.reports["r0"]
    now[0] = 1.0
    assert "vllm" in replicas.replicas[0].report()  # due again: read again
    scraped = _vllm(ingress.metrics(_request("GET", "/metrics")).body.decode())
    single = _vllm(state.metrics.render().decode())  # the replica's own /metrics
    assert single and scraped.keys() == single.keys()
    for name, samples in single.items():
        for (sample, labels), value in samples.items():
            if name == "vllm:lora_requests_info":  # its value is the time of the scrape
                continue
            for replica in ("r0", "r1"):
                assert scraped[name][(sample, tuple(sorted({**dict(labels), "engine": replica}.items())))] == value
    assert scraped["vllm:prompt_tokens"][("vllm:prompt_tokens_total", (("engine", "r0"), ("model_name", "base")))] > 0
    assert "lora_runner_replica_requests_total" in ingress.metrics(_request("GET", "/metrics")).body.decode()
