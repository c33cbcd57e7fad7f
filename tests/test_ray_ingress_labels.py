"""The Ray ingress refuses two Authorization headers as the server does (issue 39 item 8), and labels
its request counter only with names it serves (issue 39 item 12): a body naming any other model (a
404 at the replica, or one of 100 KB) counts as "other", so the operator's /metrics stays bounded.
The ingress runs on a stand-in replica handle, without a Ray cluster."""

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from adapters import LoRARequest, PromptAdapterRequest  # noqa: E402
from lora_runner.entrypoints.launch import StartupAdapters  # noqa: E402
from lora_runner.entrypoints.openai.state import ServerConfig  # noqa: E402

OPERATOR = "operator-key-0000"


class ReplicaStream:
    """A replica's streamed answer: the head (a dict, as LoRAEngine's), then an empty JSON body
    (tests/test_ray_vllm_metrics.py reuses it)."""

    def __init__(self, head: dict) -> None:
        self.items = [head, b"{}"]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.items = []


class _Replicas:
    """The engine deployment's handle: 200 for served names, 404 for the rest."""

    def __init__(self, served: set[str]) -> None:
        self.served = served
        self.handle = self

    def options(self, **kwargs):
        return self

    def remote(self, method, path, headers, body):
        status = 200 if json.loads(body)["model"] in self.served else 404
        return ReplicaStream({"replica": "r0", "status": status, "headers": [("content-type", "application/json")],
                              "loads": {}, "unloads": {}, "resident": []})


def _request(body: bytes, keys: tuple[str, ...] = (OPERATOR,)):
    from starlette.requests import Request

    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": [*((b"authorization", f"Bearer {key}".encode()) for key in keys),
                         (b"content-type", b"application/json")]}
    return Request(scope, receive)


def test_only_served_names_label_the_request_counter():
    from lora_runner.entrypoints.ray.ingress import Ingress
    from lora_runner.entrypoints.ray.metrics import render_metrics

    served = {"base", "r4", "soft"}
    ingress = Ingress(_Replicas(served), ServerConfig("base", api_keys=(OPERATOR,)),
                      StartupAdapters(loras=(LoRARequest("r4", "/nowhere/r4"),),
                                      prompt_adapters=(PromptAdapterRequest("soft", "/nowhere/soft"),)))

    async def ask(models):
        for model in models:
            await ingress.generate(_request(json.dumps({"model": model, "prompt": "hi"}).encode()))

    hostile = [f"{'m' * 100_000}-{i}" for i in range(30)] + ["no-such-model"]
    asyncio.run(ask(["base", "r4", "soft", *hostile]))
    labels = {model for _, model in ingress.requests}
    assert labels == {"base", "r4", "soft", "other"}, sorted(label[:20] for label in labels)
    assert ingress.requests[("r0", "other")] == len(hostile)
    assert len(render_metrics(ingress.requests, ingress.reports)) < 10_000


def _ingress():
    from lora_runner.entrypoints.ray.ingress import Ingress

    return Ingress(_Replicas({"base"}), ServerConfig("base", api_keys=(OPERATOR,)), StartupAdapters())


def test_two_authorization_headers_are_refused_by_the_ingress():
    from lora_runner.entrypoints.openai.errors import APIError

    body = json.dumps({"model": "base", "prompt": "hi"}).encode()
    for keys in [(OPERATOR, OPERATOR), (OPERATOR, "no-such-key-0000"), ("no-such-key-0000", OPERATOR)]:
        with pytest.raises(APIError) as refused:
            asyncio.run(_ingress().generate(_request(body, keys)))
        assert refused.value.status in (400, 401)
    asyncio.run(_ingress().generate(_request(body)))  # one header: forwarded
