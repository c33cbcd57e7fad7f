"""lora-runner on Ray Serve: 2 engine replicas of the tiny model, 6 LoRAs multiplexed.

One local Ray instance and one Serve application, driven through its scenarios by one test (slow:
replicas start in their own processes). Outputs are checked against LLM.generate; routing against the replica header and the
per-replica adapter-load counters in /metrics.
"""

import random
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serve_support import PROMPTS, offline_greedy, serve_args, serve_configs, token_ids

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

pytestmark = pytest.mark.slow


def ray_application(args):
    """The Serve application of parsed `serve` options (the configs `serve` builds, then the deployments)."""
    from lora_runner.entrypoints.cli import ray_config
    from lora_runner.entrypoints.ray.app import build_application

    return build_application(*serve_configs(args), ray_config(args))

KEY = "sk-ray"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 6
TIMEOUT = httpx.Timeout(120.0)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def loras(engine_checkpoint, tmp_path_factory):
    """The five engine-test LoRAs and a sixth."""
    from factories import save_lora

    model_dir, hf, adapters = engine_checkpoint
    sixth = tmp_path_factory.mktemp("ray") / "r4-six"
    save_lora(hf, sixth, seed=6, r=4, lora_alpha=8, scale=0.15)
    return {**{name: path for name, (path, _) in adapters.items()}, "r4-six": str(sixth)}


@pytest.fixture(scope="module")
def broken(loras, tmp_path_factory):
    """A LoRA whose weights file is garbage: fine at startup (loaded lazily), 422 when requested."""
    root = tmp_path_factory.mktemp("ray-broken")
    shutil.copy(Path(loras["r4"]) / "adapter_config.json", root / "adapter_config.json")
    (root / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return str(root)


# On a 2-core CI box running the rest of the suite beside this module, a replica can take longer than
# Serve's 0.1 s default to answer the router's queue-length probe; a late answer counts as "busy" and
# the router then sends the request to a replica without the adapter (a new load): affinity would
# depend on CPU contention. These deadlines only tolerate slow answers; routing rules are Serve's own.
SERVE_ROUTER_ENV = {"RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2",
                    "RAY_SERVE_MAX_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "5"}


@pytest.fixture(scope="module")
def cluster(engine_checkpoint, loras, broken):
    """(base URL, model dir) of the Serve app on a local Ray instance (torn down after the module)."""
    model_dir = engine_checkpoint[0]
    ray.init(num_cpus=6, include_dashboard=False, object_store_memory=200 * 1024 ** 2, log_to_driver=False,
             runtime_env={"env_vars": SERVE_ROUTER_ENV})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = serve_args(model_dir, {**loras, "broken": broken}, extra=["--num-replicas", "2", "--replica-cpus", "1",
                                                   "--max-cpu-loras", "6", "--max-adapters-per-replica", "6",
                                                   "--api-key", KEY])
        serve.run(ray_application(args), name="lora-runner", route_prefix="/")
        yield f"http://127.0.0.1:{port}", model_dir
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def http(cluster):
    with httpx.Client(base_url=cluster[0], headers=AUTH, timeout=TIMEOUT) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(cluster):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cluster[1])


def _complete(http, model, prompt=PROMPTS[0], **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0, **extra}
    return http.post("/v1/completions", json=body)


def _metrics(http) -> dict[str, dict[tuple, float]]:
    """name -> {((label, value), ...): sample} from /metrics."""
    response = http.get("/metrics")
    assert response.status_code == 200
    out: dict = {}
    for line in response.text.splitlines():
        match = re.fullmatch(r"(\w+?)(?:_total)?(?:\{(.*)\})? ([0-9.e+-]+)", line)
        if match and not line.startswith("#"):
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', match.group(2) or "")))
            out.setdefault(match.group(1), {})[labels] = float(match.group(3))
    return out


def _holders(http) -> dict[str, set[str]]:
    """adapter -> replicas that loaded it (and never evicted it)."""
    metrics = _metrics(http)
    loads, unloads = metrics.get("lora_runner_replica_adapter_loads", {}), metrics.get("lora_runner_replica_adapter_unloads", {})
    holders: dict = {}
    for labels, count in loads.items():
        if count > unloads.get(labels, 0):
            holders.setdefault(dict(labels)["adapter"], set()).add(dict(labels)["replica"])
    return holders


def _greedy_outputs_equal_single_process(http, cluster, loras, tokenizer):
    jobs = [(PROMPTS[i % 3], name, None) for i, name in enumerate([None, *loras])]
    expected = offline_greedy(cluster[1], jobs, MAX_TOKENS, loras)
    for (prompt, name, _), tokens in zip(jobs, expected):
        response = _complete(http, name or "base", prompt)
        assert response.status_code == 200, response.text
        assert response.headers["x-lora-runner-replica"] not in ("", "ingress")
        choice = response.json()["choices"][0]
        assert token_ids(tokenizer, choice["logprobs"]["tokens"]) == tokens, name


def _streaming_matches_whole_answer(http):
    whole = _complete(http, "r8-qv", PROMPTS[1]).json()["choices"][0]["text"]
    with http.stream("POST", "/v1/completions", json={"model": "r8-qv", "prompt": PROMPTS[1], "stream": True,
                                                      "max_tokens": MAX_TOKENS, "temperature": 0.0}) as response:
        assert response.status_code == 200
        assert response.headers["x-lora-runner-replica"] not in ("", "ingress")
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json

    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole


def _same_errors_as_single_process(http, cluster):
    unauthenticated = httpx.post(cluster[0] + "/v1/completions", json={"model": "r4", "prompt": "hi"}, timeout=TIMEOUT)
    assert unauthenticated.status_code == 401
    assert unauthenticated.json()["error"]["code"] == "invalid_api_key"
    assert unauthenticated.headers["x-lora-runner-replica"] == "ingress"
    unknown = _complete(http, "no-such-adapter")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = _complete(http, "r4", max_tokens=100000)
    assert too_long.status_code == 400 and too_long.json()["error"]["type"] == "invalid_request_error"
    bad_adapter = _complete(http, "broken")
    assert bad_adapter.status_code == 422 and bad_adapter.json()["error"]["code"] == "adapter_load_failed"
    assert bad_adapter.headers["x-lora-runner-replica"] not in ("", "ingress")
    models = http.get("/v1/models")
    assert models.status_code == 200 and {m["id"] for m in models.json()["data"]} >= {"base", "r4", "r4-six"}


def _multiplex_eviction_removes_the_adapter_from_the_engine(cluster, loras):
    """One replica that holds 2 adapters: a third evicts the least recently used from its engine."""
    args = serve_args(cluster[1], loras, extra=["--num-replicas", "1", "--replica-cpus", "1",
                                                "--max-adapters-per-replica", "2", "--max-cpu-loras", "6"])
    serve.run(ray_application(args), name="evict", route_prefix="/evict")
    try:
        with httpx.Client(base_url=cluster[0] + "/evict", timeout=TIMEOUT) as client:
            for name in ("r4", "r8-qv", "r4", "r16-mlp"):  # r8-qv is then the least recently used
                assert _complete(client, name).status_code == 200
            metrics = _metrics(client)
            evictions = metrics["lora_runner_replica_adapter_unloads"]
            in_engine = {dict(k)["adapter"] for k in metrics["lora_runner_replica_adapters_resident"]}
            resident = _complete(client, "r4").status_code
            loads = _metrics(client)["lora_runner_replica_adapter_loads"]
    finally:
        serve.delete("evict")
    assert {dict(k)["adapter"]: v for k, v in evictions.items()} == {"r8-qv": 1}
    assert in_engine == {"r4", "r16-mlp"}  # remove_lora ran in the replica's engine
    assert resident == 200 and {dict(k)["adapter"]: v for k, v in loads.items()} == {"r4": 1, "r8-qv": 1, "r16-mlp": 1}


def _affinity_no_new_loads_and_routed_to_holders(http, loras):
    for name in loras:  # every adapter requested at least once
        assert _complete(http, name).status_code == 200
    time.sleep(5.0)  # replicas push the ids they hold to Serve's routers asynchronously (~0.1 s; margin)
    before = _metrics(http)
    holders = _holders(http)
    assert set(holders) == set(loras)
    rng = random.Random(13)
    names = [rng.choice(sorted(loras)) for _ in range(100)]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda name: _complete(http, name, PROMPTS[2]), names))
    assert all(r.status_code == 200 for r in responses)
    for name, response in zip(names, responses):
        assert response.headers["x-lora-runner-replica"] in holders[name], name
    after = _metrics(http)
    assert after["lora_runner_adapter_loads"] == before["lora_runner_adapter_loads"]
    assert after["lora_runner_replica_adapter_loads"] == before["lora_runner_replica_adapter_loads"]
    served = sum(after["lora_runner_replica_requests"].values()) - sum(before["lora_runner_replica_requests"].values())
    assert served == 100
    assert len({r.headers["x-lora-runner-replica"] for r in responses}) == 2  # both replicas work


def _replica_actor(replica: str):
    """The Serve replica actor whose id is `replica` (the x-lora-runner-replica value)."""
    names = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("#" + replica)]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def _long_body(model: str, stream: bool = False) -> dict:
    """Long enough to be still generating seconds later (4 prompts x 480 tokens unless streamed)."""
    prompt = PROMPTS[0] if stream else PROMPTS[:4]
    return {"model": model, "prompt": prompt, "max_tokens": 480, "ignore_eos": True, "temperature": 0.0,
            "stream": stream}


def _killed_replica_fails_in_flight_and_survivor_takes_over(http, cluster, loras):
    holders = _holders(http)
    replicas = {r for rs in holders.values() for r in rs}
    assert len(replicas) == 2
    exclusive = {r: [a for a, rs in holders.items() if rs == {r}] for r in replicas}
    victim = max(sorted(replicas), key=lambda r: len(exclusive[r]))
    survivor = (replicas - {victim}).pop()
    assert exclusive[victim], holders
    with ThreadPoolExecutor(4) as pool, httpx.Client(base_url=cluster[0], headers=AUTH, timeout=TIMEOUT) as streamer:
        with streamer.stream("POST", "/v1/completions", json=_long_body(exclusive[victim][0], True)) as streamed:
            assert streamed.status_code == 200 and streamed.headers["x-lora-runner-replica"] == victim
            lines = streamed.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # generating on the victim now
            in_flight = [pool.submit(http.post, "/v1/completions", json=_long_body(a)) for a in exclusive[victim]]
            time.sleep(1.5)  # routed to the victim (its adapters live only there) and generating
            assert not any(f.done() for f in in_flight)
            ray.kill(_replica_actor(victim), no_restart=True)
            rest = [line for line in lines if line.startswith("data: ")]
        failed = [f.result(timeout=60) for f in in_flight]  # answered, not left to a client timeout
    assert rest and "[DONE]" not in rest[-1] and '"error"' in rest[-1]
    for response in failed:
        assert response.status_code == 503, response.text
        assert response.json()["error"]["code"] == "replica_unavailable"
    served_by = {}
    for name in sorted(loras):
        response = _complete(http, name)
        assert response.status_code == 200, response.text
        served_by[name] = response.headers["x-lora-runner-replica"]
        assert served_by[name] != victim
    after = _holders(http)
    assert all(served_by[name] in after[name] for name in loras)
    assert any(survivor in after[name] for name in exclusive[victim])  # it loaded what it lacked


def test_ray_serve_two_replicas(http, cluster, loras, tokenizer):
    """The scenarios in order on one Serve app: one test, so pytest-xdist keeps them on one worker
    (and one Ray instance); the kill comes last."""
    _greedy_outputs_equal_single_process(http, cluster, loras, tokenizer)
    _streaming_matches_whole_answer(http)
    _same_errors_as_single_process(http, cluster)
    _multiplex_eviction_removes_the_adapter_from_the_engine(cluster, loras)
    _affinity_no_new_loads_and_routed_to_holders(http, loras)
    _killed_replica_fails_in_flight_and_survivor_takes_over(http, cluster, loras)


@pytest.mark.parametrize("extra, message", [
    (["--num-replicas", "2", "--allow-runtime-lora-updating"], "--allow-runtime-lora-updating"),
    (["--num-replicas", "2", "--replica-gpus", "-1"], "--replica-gpus"),
    (["--num-replicas", "2", "--max-adapters-per-replica", "0"], "--max-adapters-per-replica"),
])
def test_cli_rejects_what_ray_serve_cannot_honour(engine_checkpoint, capsys, extra, message):
    from lora_runner.entrypoints.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", engine_checkpoint[0], "--device", "cpu", *extra])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
