"""LLMEngine fed from other threads while one thread loops on step(): add_request (token and string
prompts), abort_request, add_lora (including replacements), remove_lora, pin_lora and unpin_lora.

No sleeps: producers and the stepping thread move in rounds through a barrier (each round, every
producer makes its calls while the main thread is inside step()), and races are staged with
events, so each run exercises the same interleavings up to the order of calls within a round.

The contract (LLMEngine docstring): those calls are safe from any thread; step() is called by one
thread at a time (a concurrent second caller gets RuntimeError). Every request gets exactly one finished output; a request that was not aborted matches the
transformers/PEFT oracle of the adapter version it named, or fails alone with its AdapterError; an
aborted one holds a prefix of that; afterwards no KV block or adapter reference is left held.
"""

import random
import threading
import time

import pytest

from adapters import AdapterCapacityError, AdapterError, LoRARequest, UnknownAdapterError
from lora_runner import SamplingParams

from engine_support import make_engine, run_to_completion

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "is", "red", "blue"]
WAIT_S = 60  # hang guard for barriers and events, never reached by a working engine


CPU_LORAS = 3  # adapters kept in CPU memory while producers churn 4 sources (the shared default keeps 4)


class Producer(threading.Thread):
    """Adds requests with random adapters and prompt forms, aborts some, churns adapters meanwhile."""

    def __init__(self, engine, adapters, seed, num_requests, missing_dir, rounds: threading.Barrier):
        super().__init__(name=f"producer-{seed}")
        self.engine, self.adapters, self.rng = engine, adapters, random.Random(seed)
        self.seed, self.num_requests, self.missing_dir = seed, num_requests, missing_dir
        self.rounds = rounds  # one round: every producer's calls for one request, and one step()
        self.requests = {}  # id -> (prompt, adapter source name or None or "missing")
        self.aborted, self.errors = set(), []

    def lora(self, choice):
        if choice is None:
            return None
        if choice == "missing":
            return LoRARequest("missing", self.missing_dir)
        if choice.startswith("tenant="):  # one name, two sources: every switch is a hot replacement
            return LoRARequest("tenant", self.adapters[choice[len("tenant="):]][0])
        return LoRARequest(choice, self.adapters[choice][0])

    def run(self):
        rng = self.rng
        try:
            for i in range(self.num_requests):
                self.rounds.wait(WAIT_S)
                request_id = f"p{self.seed}-{i}"
                choice = rng.choice([None, "r4", "r8-qv", "r16-mlp", "tenant=r4", "tenant=r8-rslora", "missing"])
                if rng.random() < 0.3:
                    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
                else:
                    prompt = [rng.randrange(3, 256) for _ in range(rng.randint(1, 12))]
                self.requests[request_id] = (prompt, choice)
                self.engine.add_request(request_id, prompt, PARAMS, lora_request=self.lora(choice))
                if rng.random() < 0.25:
                    victim = rng.choice(list(self.requests))
                    self.engine.abort_request(victim)
                    self.aborted.add(victim)
                self.churn()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)
            self.rounds.abort()  # the stepping thread stops waiting and reports it

    def churn(self):
        rng, engine = self.rng, self.engine
        op = rng.choices(["none", "add", "replace", "remove", "pin", "unpin"], weights=[8, 2, 2, 2, 1, 2])[0]
        name = rng.choice(["r4", "r8-qv", "r16-mlp", "tenant"])
        try:
            if op == "add":
                engine.add_lora(self.lora(name if name != "tenant" else "tenant=r4"))
            elif op == "replace":
                engine.add_lora(self.lora(rng.choice(["tenant=r4", "tenant=r8-rslora"])))
            elif op == "remove":
                engine.remove_lora(name)
            elif op == "pin":
                engine.pin_lora(name)
            elif op == "unpin":
                engine.unpin_lora(name)
        except UnknownAdapterError:
            pass
        except AdapterCapacityError:  # a pin over the CPU cache's capacity
            pass


def test_engine_fed_from_threads_while_stepping(engine_checkpoint, greedy_oracle, tmp_path):
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path, max_num_seqs=8, max_cpu_loras=CPU_LORAS)
    tokenizer = engine.tokenizer.get()
    num_rounds = 10
    rounds = threading.Barrier(4)  # three producers and this thread
    producers = [Producer(engine, adapters, seed, num_rounds, str(tmp_path / "missing"), rounds)
                 for seed in range(3)]
    for producer in producers:
        producer.start()
    done, reported = {}, []

    def step():
        for output in engine.step():
            if output.finished:
                reported.append(output.request_id)
                done[output.request_id] = output

    deadline = time.monotonic() + 300  # hang guard only (background adapter loads take real time)
    steps = 0
    while steps < num_rounds or engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the step loop did not drain"
        if steps < num_rounds:  # producers make their calls while this step runs
            try:
                rounds.wait(WAIT_S)
            except threading.BrokenBarrierError:
                break  # a producer failed: its error is asserted below
        step()
        steps += 1
        # unpin now and then: with both slots pinned, requests for other LoRAs fail (by design)
        if steps % 2 == 0:
            for name in ("r4", "r8-qv", "r16-mlp", "tenant"):
                try:
                    engine.unpin_lora(name)
                except UnknownAdapterError:
                    pass
    for producer in producers:
        producer.join()
        assert producer.errors == []

    requests = {rid: spec for p in producers for rid, spec in p.requests.items()}
    aborted = set().union(*(p.aborted for p in producers))
    assert sorted(reported) == sorted(requests), "every request is reported finished exactly once"
    for request_id, (prompt, choice) in requests.items():
        output, completion = done[request_id], done[request_id].outputs[0]
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert output.prompt_token_ids == ids
        if completion.finish_reason == "abort":
            assert request_id in aborted
        if choice == "missing":
            assert completion.finish_reason in ("error", "abort") and completion.token_ids == []
            assert completion.finish_reason == "abort" or isinstance(output.error, AdapterError)
            continue
        if completion.finish_reason == "error":  # only legal failure: every slot pinned by other adapters
            assert isinstance(output.error, AdapterCapacityError) and "pinned" in str(output.error), output.error
            continue
        source = None if choice is None else choice.split("=")[-1]
        model = hf if source is None else adapters[source][1]
        expected = greedy_oracle(model, ids, PARAMS.max_tokens)[0]
        if completion.finish_reason == "abort":
            assert completion.token_ids == expected[:len(completion.token_ids)], request_id
        else:
            assert completion.finish_reason == "length" and completion.token_ids == expected, (request_id, choice)
    assert len(aborted) > 0 and sum(done[r].outputs[0].finish_reason == "length" for r in requests) > len(requests) / 3

    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.holders() == []
    tier = engine.adapters.manager.loras
    for name in ("r4", "r8-qv", "r16-mlp", "tenant"):  # no request holds a reference any more:
        try:  # removing every adapter frees everything at once, nothing is deferred
            engine.unpin_lora(name)
            engine.remove_lora(name)
        except UnknownAdapterError:
            pass
    stats = tier.memory_stats()
    assert stats["num_cpu"] == 0 and stats["num_resident"] == 0 and stats["cpu_bytes"] == 0


class ObservedLock:
    """Stands in for a lock and sets ``contended`` when a thread has to wait for it."""

    def __init__(self, lock, contended: threading.Event):
        self._lock, self._contended = lock, contended

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(blocking=False):
            return True
        if not blocking:
            return False
        self._contended.set()
        return self._lock.acquire(timeout=timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@pytest.mark.parametrize("call", ["pin", "remove"])
def test_adapter_calls_between_schedule_and_activate(engine_checkpoint, greedy_oracle, call):
    """A pin (or remove) from another thread races the step between the scheduler's pick and the
    placement of its adapters. The step must still run every request it scheduled with the right weights."""
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path)
    loras = {name: LoRARequest(name, adapters[name][0]) for name in ("r4", "r8-qv", "r16-mlp")}
    for request in loras.values():
        engine.add_lora(request)
    # r4 and r8-qv become resident; r4 is then the least recently used slot
    engine.add_request("warm-r4", [5, 6], SamplingParams(temperature=0, max_tokens=1), lora_request=loras["r4"])
    engine.step()
    engine.add_request("warm-qv", [5, 6], SamplingParams(temperature=0, max_tokens=1), lora_request=loras["r8-qv"])
    engine.step()
    engine.add_request("mlp", [7, 8, 9], PARAMS, lora_request=loras["r16-mlp"])  # will evict r4's slot
    engine.add_request("qv", [10, 11], PARAMS, lora_request=loras["r8-qv"])
    place, other, settled = engine.adapters.place, {}, threading.Event()
    engine.adapters.step_lock = ObservedLock(engine.adapters.step_lock, contended=settled)

    def race():
        getattr(engine, f"{call}_lora")("r4")
        settled.set()

    def race_then_place(scheduled):
        if "thread" not in other:  # once: another thread pins the slot the step is about to evict
            other["thread"] = threading.Thread(target=race, name="racer")
            other["thread"].start()
            # the call has either finished (it landed before placement) or waits for the step's
            # adapter lock (it lands after placement): both are legal, neither is a guess
            assert settled.wait(WAIT_S)
        return place(scheduled)

    engine.adapters.place = race_then_place
    done = {}
    for _ in range(50):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            break
    other["thread"].join(WAIT_S)
    assert not other["thread"].is_alive()
    for request_id, prompt, name in (("mlp", [7, 8, 9], "r16-mlp"), ("qv", [10, 11], "r8-qv")):
        assert done[request_id].outputs[0].token_ids == greedy_oracle(adapters[name][1], prompt, PARAMS.max_tokens)[0]
    assert ("r4" in engine.list_loras()) == (call == "pin")


def test_step_from_a_second_thread_at_once_is_refused(engine_checkpoint, greedy_oracle):
    """step() has one caller at a time: a second thread stepping concurrently gets RuntimeError, and
    the engine carries on unharmed."""
    path, hf, _ = engine_checkpoint
    engine = make_engine(path, max_cpu_loras=CPU_LORAS)
    engine.add_request("r", [5, 6, 7], PARAMS)
    schedule, inside, leave = engine.scheduler.schedule, threading.Event(), threading.Event()

    def slow_schedule(**kwargs):
        inside.set()
        assert leave.wait(30)
        return schedule(**kwargs)

    engine.scheduler.schedule = slow_schedule
    first = threading.Thread(target=engine.step, name="stepper")
    first.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="one thread"):
        engine.step()
    leave.set()
    first.join()
    engine.scheduler.schedule = schedule
    done = run_to_completion(engine)
    assert done["r"].outputs[0].token_ids == greedy_oracle(hf, [5, 6, 7], PARAMS.max_tokens)[0]
