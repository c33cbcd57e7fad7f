"""Adapter state under a hostile tenant: pins, abort racing
add_request, CPU memory of waiting adapters, close(), bad replacements and idle waiting.

Every case runs LoRAs and, where pins and replacement apply, prompt adapters through the same
engine seam; requests that should run keep the exact greedy tokens of transformers/PEFT.
Slow or stalled loads are injected through the adapter manager's resolver (the only IO hook).
"""

import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapters import (AdapterCapacityError, InvalidAdapterError, LoRARequest, PromptAdapterRequest,
                      UnknownAdapterError)
from lora_runner import LLM, EngineClosedError, SamplingParams
from tests import factories

from engine_support import make_engine, run_to_completion, step_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
PROMPT = [5, 6, 7]
REPO_ROOT = Path(__file__).resolve().parent.parent


class GatedResolver:
    """Wraps the manager's resolver: a gated path waits for its Event (or sleeps) before resolving."""

    def __init__(self, inner):
        self.inner, self.gates, self.entered, self.sleeps = inner, {}, {}, {}

    def gate(self, path) -> threading.Event:
        self.gates[str(path)], self.entered[str(path)] = threading.Event(), threading.Event()
        return self.gates[str(path)]

    def __call__(self, path, revision, patterns, local_files_only):
        if path in self.gates:
            self.entered[path].set()
            assert self.gates[path].wait(60), f"gate of {path} never opened"
        if path in self.sleeps:
            self.sleeps[path](path)
        return self.inner(path, revision, patterns, local_files_only)

    def open_all(self):
        for gate in self.gates.values():
            gate.set()


@pytest.fixture(scope="module")
def kit(engine_checkpoint, tmp_path_factory):
    """Adapter dirs of both kinds (good, a good copy under another path, a NaN copy) and oracles."""
    path, hf, loras = engine_checkpoint
    root = tmp_path_factory.mktemp("adapter-state")
    soft = {name: (root / name, factories.save_prompt_adapter(hf, root / name, num_virtual_tokens=n, seed=n))
            for name, n in (("pa3", 3), ("pa5", 5))}
    dirs = {name: loras[name][0] for name in loras} | {name: str(d) for name, (d, _) in soft.items()}
    oracles = {name: loras[name][1] for name in loras} | {name: model for name, (_, model) in soft.items()}
    for name in ("r4", "pa3"):
        factories.save_adapter_copy(dirs[name], root / f"{name}-copy")
        factories.save_nan_copy(dirs[name], root / f"{name}-nan")
        dirs[f"{name}-copy"], dirs[f"{name}-nan"] = str(root / f"{name}-copy"), str(root / f"{name}-nan")
        oracles[f"{name}-copy"] = oracles[name]
    return SimpleNamespace(path=path, hf=hf, dirs=dirs, oracles=oracles)


KINDS = {  # kind -> the calls that differ between LoRAs and prompt adapters
    "lora": SimpleNamespace(request=LoRARequest, arg="lora_request", add="add_lora", pin="pin_lora",
                            remove="remove_lora", list="list_loras", tier="loras",
                            good=("r4", "r8-qv", "r16-mlp"), copy="r4-copy", nan="r4-nan"),
    "prompt": SimpleNamespace(request=PromptAdapterRequest, arg="prompt_adapter_request", add="add_prompt_adapter",
                              pin="pin_prompt_adapter", remove="remove_prompt_adapter", list="list_prompt_adapters",
                              tier="prompts", good=("pa3", "pa5", "pa3"), copy="pa3-copy", nan="pa3-nan"),
}


PROMPT_SLOTS = dict(max_prompt_adapters=2, max_prompt_adapter_tokens=8)  # both kinds of adapter served


def gated_engine(kit, **overrides):
    """(engine, its GatedResolver): the shared engine with prompt-adapter slots, every load through the gate."""
    engine = make_engine(kit.path, **(PROMPT_SLOTS | overrides))
    resolver = GatedResolver(engine.adapters.manager._resolver)
    engine.adapters.manager._resolver = resolver
    return engine, resolver


def add(engine, kind, request_id, name, source, prompt=PROMPT, params=GREEDY):
    engine.add_request(request_id, prompt, params, **{KINDS[kind].arg: KINDS[kind].request(name, source)})


def assert_tokens(kit, output, source, greedy_oracle, prompt=PROMPT):
    completion = output.outputs[0]
    assert completion.finish_reason == "length", (output.request_id, completion.finish_reason, output.error)
    assert completion.token_ids == greedy_oracle(kit.oracles[source], prompt, GREEDY.max_tokens)[0], output.request_id


def wait_settled(tier, ref, timeout=60.0):
    deadline = time.monotonic() + timeout
    while tier.state(ref) == "loading":
        assert time.monotonic() < deadline, f"{ref} still loading"
        time.sleep(0.002)


# ---------------------------------------------------------------------------------------- pins
@pytest.mark.parametrize("kind", KINDS)
def test_pin_on_a_replaced_name_never_makes_step_raise(kit, greedy_oracle, kind):
    """4(a): a request on the old version of a name that was then replaced and pinned waits for a slot
    instead of making every step raise AdapterCapacityError; all requests keep their tokens."""
    k = KINDS[kind]
    engine, resolver = gated_engine(kit)
    old_source, new_source, other = kit.dirs[k.copy], kit.dirs[k.good[0]], k.good[1]
    gate = resolver.gate(old_source)
    add(engine, kind, "old", "x", old_source)  # holds version 1 of "x", still loading
    getattr(engine, k.add)(k.request("x", new_source))  # version 2 takes over the name
    getattr(engine, k.pin)("x")
    add(engine, kind, "new", "x", new_source)
    done = {}
    step_until(engine, done, lambda: "new" in done)  # version 2 ran: it is resident and pinned
    gate.set()
    old_ref = getattr(engine.intake.live("old"), "lora_ref" if kind == "lora" else "prompt_adapter_ref")
    wait_settled(getattr(engine.adapters.manager, k.tier), old_ref)
    add(engine, kind, "other", other, kit.dirs[other])  # becomes admissible in the same step as "old"
    run_to_completion(engine, done=done)
    assert_tokens(kit, done["old"], k.copy, greedy_oracle)
    assert_tokens(kit, done["new"], k.good[0], greedy_oracle)
    assert_tokens(kit, done["other"], other, greedy_oracle)
    assert getattr(engine.adapters.manager, k.tier).num_pinned() == 1
    engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_load_holds_no_pin(kit, greedy_oracle, kind):
    """4(b): pinning a name whose load then fails leaves nothing pinned or reserved; list and remove
    agree that the name is gone, and the full pin budget is free again."""
    k = KINDS[kind]
    engine, resolver = gated_engine(kit)
    tier = getattr(engine.adapters.manager, k.tier)
    gate = resolver.gate(kit.dirs[k.nan])
    add(engine, kind, "doomed", "z", kit.dirs[k.nan])
    getattr(engine, k.pin)("z")  # pinned while it loads
    assert tier.num_pinned() == 1
    gate.set()
    wait_settled(tier, getattr(engine.intake.live("doomed"), "lora_ref" if kind == "lora" else "prompt_adapter_ref"))
    assert tier.num_pinned() == 0  # while the request still holds the failed version
    done = run_to_completion(engine)
    assert done["doomed"].outputs[0].finish_reason == "error"
    assert isinstance(done["doomed"].error, InvalidAdapterError)
    assert tier.num_pinned() == 0 and tier.reserved_slots(set()) == 0
    assert "z" not in getattr(engine, k.list)()
    with pytest.raises(UnknownAdapterError):
        getattr(engine, k.remove)("z")
    good = k.good[0]
    getattr(engine, k.add)(k.request(good, kit.dirs[good]))
    getattr(engine, k.pin)(good)  # the one pin max_*=2 allows is free again
    add(engine, kind, "after", good, kit.dirs[good])
    assert_tokens(kit, run_to_completion(engine)["after"], good, greedy_oracle)
    engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_bad_replacement_keeps_the_old_version_serving_and_pinned(kit, greedy_oracle, kind):
    """4(b) and 9: add_* of a bad new version under a known, pinned name raises and changes nothing:
    the old version keeps serving and keeps its pin; a request naming the bad source fails alone."""
    k = KINDS[kind]
    engine, _ = gated_engine(kit)
    tier = getattr(engine.adapters.manager, k.tier)
    good = kit.dirs[k.good[0]]
    getattr(engine, k.add)(k.request("x", good))
    getattr(engine, k.pin)("x")
    with pytest.raises(InvalidAdapterError, match="NaN"):
        getattr(engine, k.add)(k.request("x", kit.dirs[k.nan]))
    assert getattr(engine, k.list)() == ["x"] and tier.num_pinned() == 1
    add(engine, kind, "bad", "x", kit.dirs[k.nan])  # the same through add_request: fails alone
    add(engine, kind, "good", "x", good)
    done = run_to_completion(engine)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert_tokens(kit, done["good"], k.good[0], greedy_oracle)
    assert getattr(engine, k.list)() == ["x"] and tier.num_pinned() == 1
    getattr(engine, k.remove)("x")
    assert tier.num_pinned() == 0 and getattr(engine, k.list)() == []
    engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_pins_leave_a_slot_for_unpinned_adapters(kit, greedy_oracle, kind):
    """4(c): with 2 slots one pin is allowed and a second is refused; pinned and unpinned requests all run."""
    k = KINDS[kind]
    engine, _ = gated_engine(kit)
    names = k.good[:2]
    for name in names:
        getattr(engine, k.add)(k.request(name, kit.dirs[name]))
    getattr(engine, k.pin)(names[0])
    getattr(engine, k.pin)(names[0])  # idempotent
    with pytest.raises(AdapterCapacityError, match="at least one must stay free"):
        getattr(engine, k.pin)(names[1])
    for i, name in enumerate([*names, names[0], names[1]]):
        add(engine, kind, f"r{i}", name, kit.dirs[name])
    done = run_to_completion(engine)
    for i, name in enumerate([*names, names[0], names[1]]):
        assert_tokens(kit, done[f"r{i}"], name, greedy_oracle)
    engine.close()


# ------------------------------------------------------------------------- abort vs add_request
def test_abort_racing_add_request_reports_the_request_once(kit, greedy_oracle, monkeypatch):
    """An abort that lands while add_request is acquiring adapters neither reports the request twice
    nor releases what it never acquired; an abort after add_request returned finishes it once."""
    engine, _ = gated_engine(kit)
    in_window, resume = threading.Event(), threading.Event()
    acquire = engine.adapters.acquire

    def slow_acquire(request):
        acquire(request)
        if request.request_id.startswith("raced"):
            in_window.set()
            assert resume.wait(30)

    monkeypatch.setattr(engine.adapters, "acquire", slow_acquire)
    done = {}
    for request_id, abort_again in (("raced", False), ("raced-then-aborted", True)):
        in_window.clear(), resume.clear()
        adder = threading.Thread(target=add, args=(engine, "lora", request_id, "r4", kit.dirs["r4"]))
        adder.start()
        assert in_window.wait(30)
        engine.abort_request(request_id)  # inside the window: the id is not visible yet
        engine.step()  # a step in the window must not touch it either
        resume.set()
        adder.join(30)
        if abort_again:
            engine.abort_request(request_id)
        run_to_completion(engine, done=done)
    assert_tokens(kit, done["raced"], "r4", greedy_oracle)
    assert done["raced-then-aborted"].outputs[0].finish_reason == "abort"
    add(engine, "lora", "later", "r4", kit.dirs["r4"])  # later steps are fine
    assert_tokens(kit, run_to_completion(engine, done=done)["later"], "r4", greedy_oracle)
    engine.remove_lora("r4")
    assert engine.adapters.manager.loras.memory_stats()["num_cpu"] == 0  # nothing still held
    engine.close()


# ------------------------------------------------------------------------ CPU memory of adapters
def test_waiting_requests_with_distinct_adapters_keep_cpu_memory_bounded(kit, greedy_oracle):
    """30 waiting requests with 30 distinct adapters and max_cpu_loras=2: at most max_cpu_loras +
    (load_workers + download_workers) adapter versions ever hold weights; every request finishes
    with its adapter's tokens."""
    engine, _ = gated_engine(kit, max_cpu_loras=2)
    tier = engine.adapters.manager.loras
    alive, peak, load = [0], [0], tier._load_fn
    lock = threading.Lock()

    def counting_load(request):
        weights = load(request)
        with lock:
            alive[0] += 1
            peak[0] = max(peak[0], alive[0])
        weakref.finalize(weights, lambda: alive.__setitem__(0, alive[0] - 1))
        return weights

    tier._load_fn = counting_load
    sources = ["r4", "r8-qv", "r16-mlp"]
    for i in range(30):
        add(engine, "lora", f"t{i}", f"tenant-{i}", kit.dirs[sources[i % 3]])
    done = run_to_completion(engine)
    bound = 2 + tier.max_loading
    assert tier.max_loading == 10 and peak[0] <= bound, (peak[0], bound)
    for i in range(30):
        assert_tokens(kit, done[f"t{i}"], sources[i % 3], greedy_oracle)
    assert tier.load_stats() == dict(ready=len(engine.list_loras()), loading=0, queued=0)
    engine.close()


# --------------------------------------------------------------------------------------- close
def test_close_returns_at_once_with_a_stalled_download_and_fails_its_requests(kit, greedy_oracle):
    engine, resolver = gated_engine(kit)
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    def stall(path):  # a Hub download that hangs until the test releases it (or 60 s pass)
        entered.set()
        release.wait(60)
        left.set()

    resolver.sleeps["org/stalled"] = stall
    try:
        add(engine, "lora", "stalled", "s", "org/stalled")
        add(engine, "lora", "queued", "q", kit.dirs["r8-qv"])
        engine.step()
        add(engine, "lora", "ready", "r4", kit.dirs["r4"])
        assert entered.wait(60), "the stalled download never started"
        engine.close()
        assert not left.is_set(), "close() waited for the stalled download"  # it returned while stalled
        for call in (lambda: add(engine, "lora", "late", "r4", kit.dirs["r4"]),
                     lambda: engine.add_lora(LoRARequest("r8-qv", kit.dirs["r8-qv"])),
                     lambda: engine.pin_lora("r4"),
                     lambda: engine.add_prompt_adapter(PromptAdapterRequest("pa3", kit.dirs["pa3"]))):
            with pytest.raises(EngineClosedError):
                call()
        assert not engine.intake.in_use("late")  # nothing registered
        done = run_to_completion(engine, timeout=10)
        assert done["stalled"].outputs[0].finish_reason == "error" and "cancelled" in str(done["stalled"].error)
        assert not engine.has_unfinished_requests()
        assert {o.outputs[0].finish_reason for o in done.values()} <= {"error", "length"}
        engine.close()  # idempotent
    finally:
        release.set()
        resolver.sleeps.clear()


def test_process_exit_does_not_wait_for_a_stalled_download():
    """A download that never returns holds neither close() nor the interpreter's exit: the script's
    last line runs while the resolver is still stalled, and the process ends (a wait would hang it
    until proc.wait's hang guard)."""
    script = """
import sys, threading
from adapters import AdapterManager, LoRARequest, ModelSpec
entered, released = threading.Event(), threading.Event()
def resolver(path, revision, patterns, local_files_only):
    entered.set()
    released.wait()  # never set: the download stalls for good
spec = ModelSpec(num_layers=1, hidden_size=8, num_heads=2, num_kv_heads=2, head_dim=4, intermediate_size=8)
manager = AdapterManager(spec, max_loras=1, max_lora_rank=4, max_cpu_loras=1, resolver=resolver)
manager.loras.acquire(LoRARequest("x", "org/stalled"))
assert entered.wait(30)
manager.close()
print(f"closed while stalled={not released.is_set()}", flush=True)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        proc.wait(timeout=60)  # hang guard: a process waiting for the stalled thread never exits
    finally:
        proc.kill()
    assert line.strip() == "closed while stalled=True" and proc.returncode == 0, (line, proc.returncode)


# ------------------------------------------------------------------------- no busy wait on a load
def test_waiting_for_a_slow_load_sleeps_instead_of_spinning(kit, greedy_oracle):
    """While the only request waits for its adapter, LLM.generate's loop sleeps on load completion:
    it steps at most twice while the load is held (a spinning loop steps hundreds of times in the
    0.2 s the load is held); wait_for_work wakes on the load."""
    llm = LLM(kit.path, device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=2,
              max_model_len=32, block_size=4)
    resolver = GatedResolver(llm.engine.adapters.manager._resolver)
    llm.engine.adapters.manager._resolver = resolver
    steps, real_step = [], llm.engine.step
    llm.engine.step = lambda: steps.append(None) or real_step()
    during_load = {}

    def slow(path):  # the load is held 0.2 s, well inside generate's 1 s safety-net wait
        during_load["start"], release = len(steps), threading.Event()
        threading.Timer(0.2, release.set).start()
        assert release.wait(30)
        during_load["end"] = len(steps)

    resolver.sleeps[kit.dirs["r4-copy"]] = slow
    llm.engine.add_request("slow", PROMPT, GREEDY, lora_request=LoRARequest("slow", kit.dirs["r4-copy"]))
    outputs = llm._run(["slow"], use_tqdm=False)
    del llm.engine.step
    assert_tokens(kit, outputs[0], "r4-copy", greedy_oracle)
    # the idle step that found nothing to run, and at most one wake-up of the safety net
    assert during_load["end"] - during_load["start"] <= 2, during_load
    # the engine-level hook: returns at once while there is work, then sleeps until a load lands
    engine = llm.engine
    gate = resolver.gate(kit.dirs["r8-qv"])
    engine.add_request("gated", PROMPT, GREEDY, lora_request=LoRARequest("g", kit.dirs["r8-qv"]))
    engine.step()  # every request waits for its adapter: an idle step
    assert engine.wait_for_work(timeout=0.05) is False
    threading.Timer(0.2, gate.set).start()
    assert engine.wait_for_work(timeout=30) is True
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            done[output.request_id] = output
        engine.wait_for_work(timeout=1.0)
    assert_tokens(kit, done["gated"], "r8-qv", greedy_oracle)
    llm.close()
