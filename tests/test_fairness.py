"""A busy pair of tenants must not starve a third; admission is fair across tenants.

The fair policy is the Virtual Token Counter (lora_runner.core.fairness): unit tests of the counters and
the order, then the scheduler with a fake model (many steps, exact), then the engine on the tiny
Llama and its PEFT adapters: the three-tenant case of the issue (C's first token within a stated
number of steps; FCFS starves it within the same number) and a skewed load (one tenant sends 10x
the requests of two others; each backlogged tenant's served-token share near 1/3). Every request's
tokens equal the transformers/PEFT greedy oracle of that request alone: fairness changes when a
request runs, never what it computes.
"""

import itertools
import random

import pytest

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner import SamplingParams
from lora_runner.config import EngineConfig
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.fairness import FairQueue, VirtualTokenCounter, served_tokens, tenant_of
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler

from engine_support import make_engine, run_to_completion

# ------------------------------------------------------------------------------- counters and order


def make_request(i, prompt_len=4, max_tokens=4, tenant=None, lora=None):
    return Request(f"r{i}", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival=i, tenant=tenant, lora_ref=lora)


def test_counter_charges_prefill_and_decode_with_their_weights():
    vtc = VirtualTokenCounter(prefill_weight=1, decode_weight=3)
    vtc.join("a")
    vtc.charge("a", num_prefill=10, num_decode=2)
    assert vtc.counter("a") == 16
    with pytest.raises(AssertionError):
        vtc.charge("idle", 1, 0)  # only active tenants are served


@pytest.mark.parametrize("weight", [0, -1, float("nan"), float("inf"), True, "1"])
def test_bad_weights_and_policy_are_value_errors(weight):
    with pytest.raises(ValueError, match="decode_weight"):
        VirtualTokenCounter(decode_weight=weight)
    with pytest.raises(ValueError, match="fairness_prefill_weight"):
        EngineConfig(model="unused", device="cpu", fairness_prefill_weight=weight)
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="unused", device="cpu", scheduling_policy="lottery")
    with pytest.raises(ValueError, match="policy"):
        Scheduler(BlockManager(4, 4), max_num_seqs=1, max_num_batched_tokens=4, max_loras=1,
                  adapter_state=lambda ref: "ready", policy="FAIR")


def test_idle_return_gets_no_credit():
    vtc = VirtualTokenCounter()
    for tenant in "abc":
        vtc.join(tenant)
    vtc.charge("a", 100, 0)
    vtc.charge("b", 40, 0)
    vtc.charge("c", 70, 0)
    vtc.leave("b")  # b idles at 40 while a and c are served on
    vtc.charge("a", 50, 0)
    vtc.charge("c", 50, 0)
    vtc.join("b")  # lifted to the smallest active counter: c's 120
    assert vtc.counter("b") == 120
    vtc.join("new")  # a tenant never seen starts there too
    assert vtc.counter("new") == 120
    vtc.leave("a")
    vtc.join("a")  # a returning tenant ahead of the others keeps its own, larger counter
    assert vtc.counter("a") == 150


def test_return_when_nobody_is_active_lifts_to_the_last_idle_counter():
    vtc = VirtualTokenCounter()
    vtc.join("a")
    vtc.join("b")
    vtc.charge("a", 90, 0)
    vtc.charge("b", 30, 0)
    vtc.leave("b")
    vtc.leave("a")  # a goes idle last, at 90: a newcomer must not undercut it
    vtc.join("c")
    assert vtc.counter("c") == 90
    vtc.join("b")
    assert vtc.counter("b") == 90


def test_counters_of_idle_tenants_are_forgotten_only_when_the_lift_erases_them():
    vtc = VirtualTokenCounter()
    vtc.join("busy")
    vtc.join("rich")
    vtc.charge("rich", 10_000, 0)  # served far more than anyone: must be remembered
    vtc.leave("rich")
    for i in range(500):  # many one-request tenants come and go
        vtc.join(f"t{i}")
        vtc.charge(f"t{i}", 5, 0)
        vtc.charge("busy", 5, 0)
        vtc.leave(f"t{i}")
    assert len(vtc._counters) < 200  # bounded by the active tenants, not by every tenant ever seen
    vtc.join("rich")
    assert vtc.counter("rich") == 10_000


def test_fair_queue_takes_the_least_served_tenant_and_reorders_as_it_admits():
    vtc = VirtualTokenCounter(prefill_weight=1, decode_weight=1)
    a1, a2, b1, b2, c1 = (make_request(i, tenant=t) for i, t in enumerate("aabbc"))
    for r in (a1, a2, b1, b2, c1):
        vtc.join(r.tenant)
    vtc.charge("b", 3, 0)
    vtc.charge("c", 9, 0)
    queue = FairQueue([a1, b1, a2, b2, c1], vtc)
    assert queue.pop() is a1  # a: 0
    queue.charge(a1, 4, 1)  # a: 5 -> b (3) is least served now
    assert queue.pop() is b1
    assert queue.pop() is b2  # b1 was not admitted (no charge): b is still least served
    assert queue.pop() is a2
    assert queue.pop() is c1
    assert queue.pop() is None


def test_tenant_is_the_id_else_the_adapter_name_else_base():
    lora, soft = LoRARequest("sql", "/x"), PromptAdapterRequest("soft", "/y")
    assert tenant_of(Request("r", [3], SamplingParams(), 0, lora_request=lora)) == "sql"
    assert tenant_of(Request("r", [3], SamplingParams(), 0, lora_request=lora, tenant="acme")) == "acme"
    assert tenant_of(Request("r", [3], SamplingParams(), 0, prompt_adapter_request=soft)) == "soft"
    assert tenant_of(Request("r", [3], SamplingParams(), 0)) == ""


def test_served_tokens_add_up_to_prompt_and_output_and_recompute_counts_as_prefill():
    request = make_request(0, prompt_len=10, max_tokens=3)
    total = [0, 0]

    def serve(num_new):
        samples = request.num_computed_tokens + num_new == request.num_tokens
        prefill, decode = served_tokens(request, num_new, samples)
        total[0] += prefill
        total[1] += decode
        request.num_computed_tokens += num_new
        if samples:
            request.token_ids.append(7)

    serve(6)  # chunked prefill
    serve(4)  # last chunk: first output token
    serve(1)  # decode
    assert total == [10, 2]
    request.preempt()
    serve(request.num_tokens)  # recompute 12 tokens: 11 prefill, the last output fed back, 1 generated
    assert total == [21, 3]


# ------------------------------------------------------------------- scheduler with a fake model


def advance(sched, out):
    """What the engine does after the model ran; returns the finished requests."""
    finished = []
    for s in out.scheduled:
        request = s.request
        request.num_computed_tokens += s.num_new_tokens
        if s.samples:
            request.token_ids.append(7)
            if request.num_output_tokens >= request.params.max_tokens:
                request.finish("length")
                sched.remove(request)
                finished.append(request)
    return finished


def weighted_service(out, prefill_weight=1, decode_weight=2):
    """tenant -> weighted tokens this step served it (computed here, not by the scheduler)."""
    served = {}
    for s in out.scheduled:
        decode = 1 if s.samples else 0
        prefill = s.num_new_tokens - (1 if s.samples and s.request.num_output_tokens > 0 else 0)
        served[s.request.tenant] = served.get(s.request.tenant, 0) + prefill_weight * prefill + decode_weight * decode
    return served


def test_idle_tenant_returning_shares_equally_instead_of_taking_everything():
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=2, max_num_batched_tokens=64, max_loras=2,
                      adapter_state=lambda ref: "ready")
    ids = itertools.count()
    for _ in range(60):  # a alone, backlogged, for 60 steps: b was idle meanwhile
        sched.add(make_request(next(ids), tenant="a"))
    for _ in range(60):
        advance(sched, sched.schedule())
    for _ in range(30):
        sched.add(make_request(next(ids), tenant="b"))
    served = {"a": 0, "b": 0}
    for _ in range(40):  # both backlogged throughout
        assert {r.tenant for r in sched.waiting} == {"a", "b"}
        out = sched.schedule()
        for tenant, tokens in weighted_service(out).items():
            served[tenant] += tokens
        advance(sched, out)
    share_b = served["b"] / sum(served.values())
    assert abs(share_b - 0.5) <= 0.1, served  # without the lift b would take ~100% for a long while


def test_handover_gives_the_starved_tenant_a_slot_and_stays_work_conserving():
    """Scheduler view of the issue's case: A and B keep two requests each in flight, C waits."""
    sched = Scheduler(BlockManager(256, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=2,
                      adapter_state=lambda ref: "ready")
    ids = itertools.count()

    def add(tenant):
        sched.add(make_request(next(ids), max_tokens=6, tenant=tenant, lora=tenant))

    def step():
        before = list(sched.waiting)
        out = sched.schedule()
        kept_waiting = {r.tenant for r in before if r in sched.waiting}
        for request in advance(sched, out):
            add(request.tenant)  # A and B replace each finished request at once; C adds one only
        return {s.request.tenant for s in out.scheduled if s.start == 0}, kept_waiting

    for when in range(10):
        if when in (0, 3):
            add("A")
            add("B")
        step()
    add("C")
    held_back = set()
    for steps in range(1, 20):
        admitted, kept_waiting = step()
        if "C" in admitted:
            break
        held_back |= kept_waiting - {"C"}
    assert steps <= 7 and "C" in admitted  # one handed-over adapter's requests (6 tokens) drained
    assert len(held_back) == 1  # one adapter gives its slot up (the same one each step), the other runs on


def test_prompt_adapter_slot_is_handed_over_too():
    """One soft-prompt slot held by "a": requests on "a" behind the waiting "b" do not join it."""
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_loras=2,
                      adapter_state=lambda ref: "ready", max_prompt_adapters=1,
                      prompt_adapter_state=lambda ref: "ready")
    a, b, a_later = (Request(f"r{i}", [5, 6], SamplingParams(max_tokens=3), arrival=i, prompt_adapter_ref=pa)
                     for i, pa in enumerate("aba"))
    for request in (a, b, a_later):
        request.insert_virtual_tokens(3)
        sched.add(request)
    out = sched.schedule()
    assert [s.request for s in out.scheduled] == [a]  # a_later would keep "a" held: b is ahead in line
    advance(sched, out)
    out = sched.schedule()  # a's soft prompt is computed: its slot is free and b takes it
    assert [s.request for s in out.scheduled if s.start == 0] == [b]


# ----------------------------------------------------------------------------- engine, tiny Llama

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
C_BOUND_STEPS = PARAMS.max_tokens + 1  # steps from C's add_request to its first token (see below)


ROWS = 8  # max_num_seqs of the three-tenant engines (the shared default is 4)


def check_tokens(done, requests, models, oracle):
    """Every finished request equals the oracle of it alone (greedy, its adapter or the base)."""
    for request_id, (model_key, prompt) in requests.items():
        tokens, _ = oracle(models[model_key], prompt, PARAMS.max_tokens)
        assert done[request_id].outputs[0].token_ids == tokens, request_id


def run_three_tenants(engine, adapters, max_steps):
    """A and B keep two staggered requests each in flight (each finished one is replaced at once);
    C adds one request once they are in steady state. Returns (steps from C's add_request to its
    first token or None, finished outputs, {id: (adapter, prompt)}) after draining everything."""
    names = {"A": "r4", "B": "r8-qv", "C": "r16-mlp"}
    loras = {tenant: LoRARequest(name, adapters[name][0]) for tenant, name in names.items()}
    for lora in loras.values():
        engine.add_lora(lora)  # in the CPU cache now: steps do not wait on background loads
    rng, ids, requests, done = random.Random(0), itertools.count(), {}, {}

    def add(tenant):
        request_id = f"{tenant}{next(ids)}"
        requests[request_id] = (names[tenant], [rng.randrange(3, 256) for _ in range(rng.randint(2, 8))])
        engine.add_request(request_id, requests[request_id][1], PARAMS, lora_request=loras[tenant])
        return request_id

    starts, c_start, c_id, c_first, refill = {0: "A", 1: "B", 3: "A", 4: "B"}, 10, None, None, True
    for step in itertools.count():
        if step in starts:
            add(starts[step])
        if step == c_start:
            c_id = add("C")
        refill = refill and step < max_steps
        for out in engine.step():
            if out.request_id == c_id and c_first is None and out.outputs[0].token_ids:
                c_first = step - c_start + 1
            if out.finished:
                done[out.request_id] = out
                if refill and out.request_id[0] in "AB":
                    add(out.request_id[0])
        if not refill and not engine.has_unfinished_requests():
            return c_first, done, requests
        assert step < max_steps + 100


def test_busy_pair_does_not_starve_a_third_tenant(engine_checkpoint, greedy_oracle):
    """Fair: C's first token within C_BOUND_STEPS steps of its add_request. Why: C's counter is
    lifted to the smaller of A's and B's, which only grow, so C is first in line; one of A/B gives
    its slot up (no new requests join it); its running requests need at most max_tokens steps; the
    step after, C is prefilled and samples. FCFS: A and B requests keep joining their held slots and
    C gets nothing in 5x as many steps (it runs only once the refills stop)."""
    path, hf, adapters = engine_checkpoint
    models = {name: adapters[name][1] for name in ("r4", "r8-qv", "r16-mlp")}
    fair_first, fair_done, fair_requests = run_three_tenants(make_engine(path, scheduling_policy="fair", max_num_seqs=ROWS), adapters, max_steps=30)
    fcfs_first, fcfs_done, fcfs_requests = run_three_tenants(make_engine(path, scheduling_policy="fcfs", max_num_seqs=ROWS), adapters,
                                                             max_steps=10 + 5 * C_BOUND_STEPS)
    assert fair_first is not None and fair_first <= C_BOUND_STEPS
    assert fcfs_first is None or fcfs_first > 5 * C_BOUND_STEPS
    assert sum(r.startswith("A") for r in fcfs_requests) > 15  # A and B were served meanwhile
    check_tokens(fair_done, fair_requests, models, greedy_oracle)
    check_tokens(fcfs_done, fcfs_requests, models, greedy_oracle)


SKEW_TOLERANCE = 0.06  # |share - 1/3| of weighted served tokens while all three are backlogged


def run_skewed(engine, adapters):
    """heavy sends 10x the requests of light-1 and light-2, all at once, interleaved 10:1:1.
    heavy and light-1 use the same LoRA (tenant ids tell them apart); light-2 is the base model
    with no tenant id (tenant ""). Returns (weighted service per tenant while every tenant had a
    waiting request, outputs, {id: (model, prompt)})."""
    lora = LoRARequest("r4", adapters["r4"][0])
    engine.add_lora(lora)
    rng, requests, done = random.Random(1), {}, {}
    for round_ in range(10):
        for tenant in ["heavy"] * 10 + ["light-1", "light-2"]:
            request_id = f"{tenant}-{len(requests)}"
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(4, 8))]
            requests[request_id] = ("base" if tenant == "light-2" else "r4", prompt)
            engine.add_request(request_id, prompt, PARAMS, lora_request=None if tenant == "light-2" else lora,
                               tenant=None if tenant == "light-2" else tenant)
    served = {"heavy": 0, "light-1": 0, "": 0}
    schedule = engine.scheduler.schedule

    def spy(**kwargs):
        backlogged = {r.tenant or "" for r in engine.scheduler.waiting} == set(served)
        out = schedule(**kwargs)
        if backlogged:
            for tenant, tokens in weighted_service(out).items():
                served[tenant or ""] += tokens
        return out

    engine.scheduler.schedule = spy
    engine.step()  # takes the intake: the window starts with every request queued
    return served, run_to_completion(engine, done=done), requests


def test_skewed_load_gives_each_backlogged_tenant_an_equal_share(engine_checkpoint, greedy_oracle):
    path, hf, adapters = engine_checkpoint
    models = {"base": hf, "r4": adapters["r4"][1]}
    shares = {}
    for policy in ("fair", "fcfs"):
        served, done, requests = run_skewed(make_engine(path, scheduling_policy=policy, max_num_seqs=3), adapters)
        total = sum(served.values())
        shares[policy] = {tenant: tokens / total for tenant, tokens in served.items()}
        assert total > 300, served  # a window long enough to mean something (10 requests per light tenant)
        check_tokens(done, requests, models, greedy_oracle)
    assert all(abs(share - 1 / 3) <= SKEW_TOLERANCE for share in shares["fair"].values()), shares
    assert shares["fcfs"]["heavy"] > 0.7, shares  # FCFS serves in proportion to requests sent


def test_tenant_must_be_a_string(engine_checkpoint):
    engine = make_engine(engine_checkpoint[0], scheduling_policy="fair", max_num_seqs=ROWS)
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request("x", [3, 4], PARAMS, tenant=7)
    assert not engine.has_unfinished_requests()
