"""Faults while serving: the Hub or the disk failing mid-load, aborts at every stage of a request,
KV-cache exhaustion, and adapters replaced or removed under running requests. Other requests always
finish exactly as transformers/PEFT compute them, and nothing stays held afterwards.

The Hub is simulated offline: ``huggingface_hub.snapshot_download`` is replaced by a fake that plays
a per-repo script of faults (an exception, a partial download, a stall until a gate opens) before
answering from a Hub cache laid out on disk.
"""

import os
import shutil
import threading
import time
from collections import Counter

import huggingface_hub
import pytest

import adapters.files as adapter_files
from adapters import AdapterNotFoundError, InvalidAdapterError, LoRARequest, UnknownAdapterError
from lora_runner import SamplingParams
from tests import factories

from engine_support import assert_exact, make_engine, run_to_completion, step_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
REPOS = {"org/flaky": "r4", "org/partial": "r16-mlp", "org/buggy": "r8-qv", "org/slow": "r8-rslora",
         "org/doomed": "r4", "org/tenant-v1": "r4", "org/gone": "r16-patterns"}  # repo -> adapter its files are


class FaultyHub:
    """Stands in for huggingface_hub.snapshot_download: per repo, an optional gate to wait on, then a
    script of faults (an exception to raise, or a callable returning a directory), then the cache."""

    def __init__(self, cache, real):
        self.cache, self.real = cache, real
        self.scripts: dict[str, list] = {}
        self.gates: dict[str, threading.Event] = {}
        self.calls: Counter[str] = Counter()

    def __call__(self, repo_id, **kwargs):
        self.calls[repo_id] += 1
        if repo_id in self.gates:
            assert self.gates[repo_id].wait(100), f"gate of {repo_id} never opened"
        script = self.scripts.get(repo_id)
        if script:
            fault = script.pop(0)
            if isinstance(fault, BaseException):
                raise fault
            return fault()
        return self.real(repo_id, **{**kwargs, "cache_dir": str(self.cache), "local_files_only": True})


@pytest.fixture
def hub(engine_checkpoint, tmp_path, monkeypatch):
    _, _, adapters = engine_checkpoint
    for i, (repo, source) in enumerate(REPOS.items()):
        factories.write_hub_cache(tmp_path / "hub", repo, adapters[source][0], f"{i:02x}" * 20)
    fake = FaultyHub(tmp_path / "hub", huggingface_hub.snapshot_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    yield fake
    for gate in fake.gates.values():  # never leave a loader thread blocked
        gate.set()


def step(engine, done):
    outputs = engine.step()
    done.update({o.request_id: o for o in outputs if o.finished})
    return outputs


def settled_state(tier, name, timeout=60.0):
    """The load state of the version `name` refers to once it stopped loading (None: forgotten)."""
    deadline = time.monotonic() + timeout
    while True:
        ref = tier.lookup(name)
        try:
            state = None if ref is None else tier.state(ref)
        except UnknownAdapterError:  # dropped between lookup and state
            continue
        if state != "loading":
            return state
        assert time.monotonic() < deadline, f"{name} still loading"
        time.sleep(0.001)


def assert_nothing_held(engine, names):
    """No KV block is held, and removing the adapters frees them at once (no request holds a ref)."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks and bm.holders() == []
    for name in names:
        if name in engine.list_loras():
            engine.remove_lora(name)
    stats = engine.adapters.manager.loras.memory_stats()
    assert (stats["num_cpu"], stats["num_resident"], stats["cpu_bytes"]) == (0, 0, 0), stats


def test_hub_and_disk_failures_fail_only_affected_requests_and_a_retry_succeeds(
        engine_checkpoint, greedy_oracle, hub, tmp_path, monkeypatch):
    path, hf, adapters = engine_checkpoint
    partial = tmp_path / "partial-download"
    shutil.copytree(adapters["r16-mlp"][0], partial)
    weights = partial / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    hub.scripts = {"org/flaky": [ConnectionError("Connection reset by peer")],
                   "org/partial": [lambda: str(partial)],
                   "org/buggy": [RuntimeError("resolver bug")]}
    hub.gates["org/flaky"] = gate = threading.Event()  # fails only once the others are well under way
    disk = {"failures": 0}

    class FlakyOs:  # adapters.files' os: the first file opened in the r8-rslora folder is an I/O error
        def __getattr__(self, attr):
            return getattr(os, attr)

        @staticmethod
        def open(name, flags, *args, dir_fd=None, **kwargs):
            folder = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else str(name)
            if "r8-rslora" in folder and not flags & os.O_DIRECTORY and disk["failures"] == 0:
                disk["failures"] += 1
                raise OSError(5, "Input/output error")
            return os.open(name, flags, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(adapter_files, "os", FlakyOs())  # the adapter file reader's opens
    engine = make_engine(path, local_files_only=True)
    good = {"base": ([5, 6, 7], None, hf), "local": ([8, 9], LoRARequest("r4", adapters["r4"][0]), adapters["r4"][1])}
    affected = {"flaky-1": ([10, 11], "flaky", "org/flaky", AdapterNotFoundError, "Connection reset by peer"),
                "flaky-2": ([12], "flaky", "org/flaky", AdapterNotFoundError, "Connection reset by peer"),
                "partial": ([13, 14], "partial", "org/partial", InvalidAdapterError, "corrupt safetensors"),
                "buggy": ([15], "buggy", "org/buggy", AdapterNotFoundError, "RuntimeError('resolver bug')"),
                "disk": ([16, 17], "rs", adapters["r8-rslora"][0], InvalidAdapterError, "Input/output error")}
    for request_id, (prompt, lora, _) in good.items():
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    for request_id, (prompt, name, where, _, _) in affected.items():
        engine.add_request(request_id, prompt, GREEDY, lora_request=LoRARequest(name, where))
    done = {}
    step_until(engine, done, lambda: len(done) == len(good) + len(affected) - 2)  # all but the gated pair
    assert {"flaky-1", "flaky-2"}.isdisjoint(done) and set(good) <= set(done)  # nobody waited for the Hub
    gate.set()
    run_to_completion(engine, done=done)
    for request_id, (_, name, _, error, fragment) in affected.items():
        output = done[request_id]
        assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == []
        assert isinstance(output.error, error) and fragment in str(output.error) and repr(name) in str(output.error)
    for request_id, (prompt, _, model) in good.items():
        assert_exact(done[request_id], model, prompt, greedy_oracle)
    assert hub.calls["org/flaky"] == 1  # both requests shared the one failed load

    sources = {"flaky": "r4", "partial": "r16-mlp", "buggy": "r8-qv", "rs": "r8-rslora"}
    for request_id, (prompt, name, where, _, _) in affected.items():  # the same requests, retried later
        engine.add_request(f"retry-{request_id}", prompt, GREEDY, lora_request=LoRARequest(name, where))
    run_to_completion(engine, done=done)
    for request_id, (prompt, name, _, _, _) in affected.items():
        assert_exact(done[f"retry-{request_id}"], adapters[sources[name]][1], prompt, greedy_oracle)
    assert hub.calls["org/flaky"] == 2 and disk["failures"] == 1
    assert_nothing_held(engine, ["r4", *sources])


def test_aborts_in_prefill_decode_and_loading_free_everything(engine_checkpoint, greedy_oracle, hub):
    """(An abort while preempted: test_preempted_lora_requests_resume_identically.)"""
    path, hf, adapters = engine_checkpoint
    hub.gates["org/slow"] = slow_gate = threading.Event()
    hub.gates["org/doomed"] = doomed_gate = threading.Event()
    hub.scripts["org/doomed"] = [ConnectionError("Hub unreachable")]
    engine = make_engine(path, local_files_only=True, max_num_batched_tokens=8)
    for name in ("r4", "r16-mlp"):  # loaded up front, so which step runs what does not depend on timing
        engine.add_lora(LoRARequest(name, adapters[name][0]))
    long_params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request("survivor", [5, 6, 7], GREEDY)
    engine.add_request("decode", [8, 9], long_params, lora_request=LoRARequest("r16-mlp", adapters["r16-mlp"][0]))
    engine.add_request("prefill", list(range(20, 50)), long_params, lora_request=LoRARequest("r4", adapters["r4"][0]))
    engine.add_request("loading", [10, 11], GREEDY, lora_request=LoRARequest("slow", "org/slow"))
    engine.add_request("loading-then-fails", [12], GREEDY, lora_request=LoRARequest("doomed", "org/doomed"))
    done, bm = {}, engine.block_manager
    step_until(engine, done, lambda: any(r.request_id == "decode" and r.num_output_tokens >= 2
                                         for r in engine.scheduler.running))
    progress = {r.request_id: r.num_output_tokens for r in engine.scheduler.running}
    assert len(bm.table("prefill")) > 0 and progress.get("prefill") == 0  # 30 prompt tokens, 8 tokens a step
    assert bm.table("loading") == [] and bm.table("loading-then-fails") == []  # still loading: no blocks
    engine.abort_request(["prefill", "decode", "decode", "loading", "loading-then-fails", "later"])
    engine.add_request("later", [14, 15], GREEDY)  # its id was unknown when the abort came: not aborted
    reported = step(engine, done)
    outputs = {o.request_id: o for o in reported}
    assert set(outputs) >= {"prefill", "decode", "loading", "loading-then-fails"}
    assert [o.request_id for o in reported].count("decode") == 1  # aborted twice, reported once
    for request_id in ("prefill", "decode", "loading", "loading-then-fails"):
        assert outputs[request_id].outputs[0].finish_reason == "abort" and bm.table(request_id) == []
    assert outputs["prefill"].outputs[0].token_ids == [] and outputs["loading"].outputs[0].token_ids == []
    decoded = outputs["decode"].outputs[0].token_ids
    assert decoded == greedy_oracle(adapters["r16-mlp"][1], [8, 9], 30)[0][:len(decoded)]
    slow_gate.set()
    doomed_gate.set()
    run_to_completion(engine, done=done)
    assert_exact(done["survivor"], hf, [5, 6, 7], greedy_oracle)
    assert_exact(done["later"], hf, [14, 15], greedy_oracle)
    tier = engine.adapters.manager.loras
    # the loads outlive their aborted requests: a success is cached (unheld), a failure nobody holds is forgotten
    assert settled_state(tier, "slow") == "ready" and settled_state(tier, "doomed") is None
    assert_nothing_held(engine, ["r4", "r16-mlp", "slow", "doomed"])


def tight_kv_bytes(hf, num_blocks, block_size=4):
    cfg = hf.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * head_dim * 4


def test_preempted_lora_requests_resume_identically(engine_checkpoint, greedy_oracle):
    """Greedy and seeded sampled LoRA requests under KV exhaustion (preemption by recompute) produce
    what an unconstrained engine produces; one request aborted while preempted frees everything."""
    path, hf, adapters = engine_checkpoint
    names = ["r4", None, "r16-patterns", "r8-rslora", "r4", "r16-mlp"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_tokens=8, ignore_eos=True, logprobs=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    requests = [(f"q{i}", [3 + 7 * i + j for j in range(6 + 3 * i)],
                 greedy if i % 2 else SamplingParams(**{**sampled.__dict__, "seed": i}),
                 LoRARequest(name, adapters[name][0]) if name else None) for i, name in enumerate(names)]
    requests.append(("victim", list(range(60, 72)), greedy, LoRARequest("r8-qv", adapters["r8-qv"][0])))

    def run(engine, abort_preempted):
        done, aborted = {}, []
        for lora in {r[3] for r in requests} - {None}:  # loaded up front: the schedule must not depend on
            engine.add_lora(lora)  # when background loads finish
        for request_id, prompt, params, lora in requests:
            engine.add_request(request_id, prompt, params, lora_request=lora)
        while engine.has_unfinished_requests():
            preempted = [r for r in engine.scheduler.waiting if r.num_preemptions and r.request_id == "victim"]
            if abort_preempted and preempted and not aborted:
                engine.abort_request("victim")
                aborted.append("victim")
            step(engine, done)
        return done, aborted

    free, _ = run(make_engine(path, max_loras=3, max_cpu_loras=6), abort_preempted=False)
    tight = make_engine(path, max_loras=3, max_cpu_loras=6, max_num_batched_tokens=12,
                        kv_cache_memory_bytes=tight_kv_bytes(hf, 16))
    assert tight.block_manager.num_blocks == 16
    done, aborted = run(tight, abort_preempted=True)
    assert tight.scheduler.num_preemptions >= 2 and aborted == ["victim"]
    for request_id, prompt, params, lora in requests:
        got, want = done[request_id].outputs[0], free[request_id].outputs[0]
        if request_id == "victim":
            assert got.finish_reason == "abort" and got.token_ids == want.token_ids[:len(got.token_ids)]
            continue
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "length", request_id
        for step_got, step_want in zip(got.logprobs, want.logprobs):
            assert step_got.keys() == step_want.keys()
            assert all(abs(step_got[t] - step_want[t]) <= 1e-4 for t in step_got), request_id
        if params.temperature == 0:
            model = adapters[lora.name][1] if lora else hf
            assert got.token_ids == greedy_oracle(model, prompt, 8)[0]
    assert_nothing_held(tight, ["r4", "r16-patterns", "r8-rslora", "r16-mlp", "r8-qv"])


def test_replace_and_remove_while_the_adapter_loads(engine_checkpoint, greedy_oracle, hub):
    """A request keeps the adapter version it was added with: the name replaced while that version
    still downloads, or removed before its files arrive. Stalled downloads (more than the loader
    has local workers) never delay adapters already on disk."""
    path, hf, adapters = engine_checkpoint
    hub.gates["org/tenant-v1"] = v1_gate = threading.Event()
    hub.gates["org/gone"] = gone_gate = threading.Event()
    hub.gates["org/slow"] = slow_gate = threading.Event()
    engine = make_engine(path, local_files_only=True)
    engine.add_request("v1", [5, 6, 7], GREEDY, lora_request=LoRARequest("tenant", "org/tenant-v1"))
    engine.add_lora(LoRARequest("tenant", adapters["r8-rslora"][0]))  # replaced while v1's version loads
    engine.add_request("v2", [5, 6, 7], GREEDY, lora_request=LoRARequest("tenant", adapters["r8-rslora"][0]))
    engine.add_request("gone", [9, 10], GREEDY, lora_request=LoRARequest("gone", "org/gone"))
    engine.remove_lora("gone")  # deferred: its request still runs on it
    engine.add_request("slow", [11], GREEDY, lora_request=LoRARequest("slow", "org/slow"))
    engine.add_request("local", [12, 13], GREEDY, lora_request=LoRARequest("r16-mlp", adapters["r16-mlp"][0]))
    done, deadline = {}, time.monotonic() + 60
    while not {"v2", "local"} <= set(done):  # three downloads stall; the adapters on disk still load and run
        assert time.monotonic() < deadline, "a stalled download delayed an adapter on disk"
        step(engine, done)
    assert {"v1", "gone", "slow"}.isdisjoint(done)
    for gate in (v1_gate, gone_gate, slow_gate):
        gate.set()
    run_to_completion(engine, done=done)
    assert_exact(done["v1"], adapters["r4"][1], [5, 6, 7], greedy_oracle)
    assert_exact(done["v2"], adapters["r8-rslora"][1], [5, 6, 7], greedy_oracle)
    assert_exact(done["gone"], adapters["r16-patterns"][1], [9, 10], greedy_oracle)
    assert_exact(done["slow"], adapters["r8-rslora"][1], [11], greedy_oracle)
    assert_exact(done["local"], adapters["r16-mlp"][1], [12, 13], greedy_oracle)
    assert "gone" not in engine.list_loras()  # removed: forgotten once its request finished
    assert_nothing_held(engine, ["tenant", "slow", "r16-mlp"])


def test_replaced_while_running_and_preempted_keeps_its_version(engine_checkpoint, greedy_oracle):
    """The name is replaced while a request runs on it; KV exhaustion then preempts that request,
    which recomputes on its retired version while newer requests run on the new one."""
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path, max_num_batched_tokens=16, max_model_len=48,
                         kv_cache_memory_bytes=tight_kv_bytes(hf, 16))
    long_params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    old, new = LoRARequest("mid", adapters["r16-mlp"][0]), LoRARequest("mid", adapters["r8-qv"][0])
    for lora in (LoRARequest("r4", adapters["r4"][0]), old):  # loaded up front: a schedule independent of timing
        engine.add_lora(lora)
    engine.add_request("bg-1", list(range(20, 32)), long_params, lora_request=LoRARequest("r4", adapters["r4"][0]))
    engine.add_request("bg-2", list(range(40, 52)), long_params)
    engine.add_request("holder", list(range(60, 72)), long_params, lora_request=old)  # newest: preempted first
    done, phase = {}, "running"
    while engine.has_unfinished_requests():
        holder = next(r for r in (*engine.scheduler.running, *engine.scheduler.waiting, None)
                      if r is None or r.request_id == "holder")
        if phase == "running" and holder is not None and holder.num_output_tokens >= 2:
            engine.add_lora(new)  # replaced mid-decode
            phase = "replaced"
        elif phase == "replaced" and holder is not None and holder.num_preemptions:
            engine.add_request("newer", list(range(80, 86)), GREEDY, lora_request=new)
            phase = "preempted"
        step(engine, done)
    assert phase == "preempted", "the KV cache was meant to preempt the holder after the replacement"
    assert_exact(done["holder"], adapters["r16-mlp"][1], list(range(60, 72)), greedy_oracle, 20, logprobs=False)
    assert_exact(done["newer"], adapters["r8-qv"][1], list(range(80, 86)), greedy_oracle)
    assert_exact(done["bg-1"], adapters["r4"][1], list(range(20, 32)), greedy_oracle, 20, logprobs=False)
    assert_exact(done["bg-2"], hf, list(range(40, 52)), greedy_oracle, 20, logprobs=False)
    assert engine.list_loras().count("mid") == 1 and engine.adapters.manager.loras.memory_stats()["num_cpu"] == 2
    assert_nothing_held(engine, ["mid", "r4"])
