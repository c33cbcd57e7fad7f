"""Tensor parallelism on Ray (distributed_executor_backend="ray"): one actor per rank in a placement group.

One local Ray instance for the module (4 CPUs: two placement groups of 2 bundles fit at once), one tp=2 Ray
engine for the equality test; the failure test builds its own and kills one actor mid-generation.
"""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest
from transformers import AutoTokenizer

from adapters import LoRARequest, PromptAdapterRequest
from engine_support import run_to_completion, start_decoding
from factories import save_prompt_adapter
from lora_runner import LLMEngine, SamplingParams
from serve_support import PROMPTS, offline_greedy, serve_args, serve_configs, token_ids

ray = pytest.importorskip("ray")


MAX_TOKENS = 6
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray instance whose workers import this checkout; shut down after the module."""
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=100 * 1024 ** 2, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dirs(engine_checkpoint, tmp_path_factory):
    """engine_checkpoint's LoRA dirs plus a soft prompt."""
    _, hf, loras = engine_checkpoint
    soft = tmp_path_factory.mktemp("tp-ray") / "soft"
    save_prompt_adapter(hf, soft, num_virtual_tokens=4, seed=7)
    return {**{name: path for name, (path, _) in loras.items()}, "soft": str(soft)}


def engine_kwargs(**overrides) -> dict:
    return dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=48, block_size=4,
                max_num_batched_tokens=16, max_loras=2, max_lora_rank=16, max_cpu_loras=8, max_prompt_adapters=1,
                max_prompt_adapter_tokens=8, **overrides)


def mixed_requests(dirs: dict) -> list[tuple]:
    """Base, two LoRAs (as many as slots), a soft prompt alone and with a LoRA."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    r4, qv = LoRARequest("r4", dirs["r4"]), LoRARequest("r8-qv", dirs["r8-qv"])
    soft = PromptAdapterRequest("soft", dirs["soft"])
    prompts = [[3, 14, 15, 92, 65], [35, 89, 79, 32, 38, 46, 26], [43, 38, 32, 79], [50, 28, 84, 19, 71, 69],
               [39, 93, 75, 10, 58, 20, 97, 49]]
    adapters = [(None, None), (r4, None), (qv, None), (None, soft), (r4, soft)]
    return [(f"m{i}", prompt, params, *adapters[i]) for i, prompt in enumerate(prompts)]


def _preload(engine: LLMEngine, dirs: dict) -> None:
    """Every adapter in the CPU cache before the run: no background load timing in the schedule."""
    for name in ("r4", "r8-qv"):
        engine.add_lora(LoRARequest(name, dirs[name]))
    engine.add_prompt_adapter(PromptAdapterRequest("soft", dirs["soft"]))


def _group_state(group) -> str:
    return ray.util.placement_group_table(group)["state"]


@pytest.mark.slow
def test_ray_tp2_equals_tp1_for_a_mixed_batch(ray_cluster, engine_checkpoint, dirs):
    model_dir = engine_checkpoint[0]
    tp1 = LLMEngine(model_dir, **engine_kwargs())
    tp2 = LLMEngine(model_dir, **engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray"))
    try:
        executor = tp2.executor
        assert type(executor).__name__ == "RayExecutor" and len(executor.actors) == 2
        assert _group_state(executor.placement_group) == "CREATED"
        assert len(executor.placement_group.bundle_specs) == 2
        for engine in (tp1, tp2):
            _preload(engine, dirs)
        want = run_to_completion(tp1, mixed_requests(dirs))
        counts = executor.counts.copy()
        got = run_to_completion(tp2, mixed_requests(dirs))
        steps = executor.counts["messages"] - counts["messages"]
        assert executor.counts["puts"] - counts["puts"] == steps > 0  # one object-store put per step
        assert executor.counts["sends"] - counts["sends"] == 2 * steps  # the same ObjectRef to each actor
        assert set(got) == set(want)
        for rid, output in want.items():
            tokens, logprobs = output.outputs[0].token_ids, output.outputs[0].logprobs
            assert got[rid].outputs[0].token_ids == tokens, rid
            assert got[rid].outputs[0].finish_reason == output.outputs[0].finish_reason
            for step, token in enumerate(tokens):
                assert abs(got[rid].outputs[0].logprobs[step][token] - logprobs[step][token]) <= 1e-4, (rid, step)
    finally:
        tp1.close()
        tp2.close()
    assert _group_state(executor.placement_group) == "REMOVED"


@pytest.mark.slow
def test_a_killed_actor_fails_every_request_and_close_leaves_nothing(ray_cluster, engine_checkpoint, dirs):
    model_dir = engine_checkpoint[0]
    engine = LLMEngine(model_dir, **engine_kwargs(tensor_parallel_size=2, distributed_executor_backend="ray"))
    executor = engine.executor
    actors, group = list(executor.actors), executor.placement_group
    done = start_decoding(engine, 4, dirs["r4"])
    ray.kill(actors[1], no_restart=True)
    started = time.monotonic()
    run_to_completion(engine, done=done, timeout=10)
    assert time.monotonic() - started < 10
    assert {rid: out.outputs[0].finish_reason for rid, out in done.items()} == {f"k{i}": "error" for i in range(4)}
    assert not engine.has_unfinished_requests() and not engine.is_alive
    engine.close()
    assert _group_state(group) == "REMOVED"
    for actor in actors:  # rank 0 was killed too: no actor answers
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(actor.ping.remote(), timeout=10)


def _application_parts(model_dir: str, loras: dict, extra: list[str]):
    from lora_runner.entrypoints.cli import ray_config

    args = serve_args(model_dir, loras, extra=extra)
    return (*serve_configs(args), ray_config(args))


def test_replica_placement_groups_hold_one_bundle_per_rank(engine_checkpoint):
    from lora_runner.entrypoints.ray.placement import replica_engine_config, replica_options

    model_dir = engine_checkpoint[0]
    engine, _, _, layout = _application_parts(model_dir, {}, ["--num-replicas", "2", "-tp", "2",
                                                              "--replica-cpus", "0.5"])
    options = replica_options(replica_engine_config(engine), layout)
    assert options["num_replicas"] == 2 and options["placement_group_strategy"] == "STRICT_PACK"
    assert options["placement_group_bundles"] == [{"CPU": 1.5}, {"CPU": 1.0}]  # 2 replicas: 4 bundles in all
    assert options["ray_actor_options"] == {"num_cpus": 0.5, "num_gpus": 0.0}  # fits the first bundle
    assert replica_engine_config(engine).executor_backend == "ray"
    assert "placement_group_bundles" not in replica_options(engine.__class__(model=model_dir), layout)
    mp_engine, _, _, _ = _application_parts(model_dir, {}, ["-tp", "2", "--distributed-executor-backend", "mp"])
    with pytest.raises(ValueError, match="--distributed-executor-backend ray"):
        replica_engine_config(mp_engine)


@pytest.mark.slow
def test_a_serve_replica_with_tp2_runs_its_ranks_in_its_placement_group(ray_cluster, engine_checkpoint, dirs):
    from ray import serve

    from lora_runner.entrypoints.ray.app import build_application

    model_dir = engine_checkpoint[0]
    loras = {"r4": dirs["r4"]}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        parts = _application_parts(model_dir, loras, ["--num-replicas", "1", "-tp", "2", "--replica-cpus", "1"])
        serve.run(build_application(*parts), name="lora-runner-tp", route_prefix="/")
        groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [list(g["bundles"].values()) for g in groups] == [[{"CPU": 2.0}, {"CPU": 1.0}]]
        got = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120.0) as http:
            for model in ("base", "r4"):
                body = {"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0.0,
                        "logprobs": 0}
                response = http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                got.append(response.json()["choices"][0]["logprobs"]["tokens"])
    finally:
        serve.shutdown()
    want = offline_greedy(model_dir, [(PROMPTS[0], None, None), (PROMPTS[0], "r4", None)], MAX_TOKENS, loras)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert [token_ids(tokenizer, tokens) for tokens in got] == want  # the replica's tp=2 engine, exact
    assert all(g["state"] == "REMOVED" for g in ray.util.placement_group_table().values())
