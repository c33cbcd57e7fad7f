"""The step's hand-off (issue 33 item 3): schedule() asks for its requests' adapters to be placed and leaves
out those that got no slot; the SchedulerOutput it returns is never edited afterwards."""

import dataclasses

import pytest

from adapters import LoRARequest
from engine_support import assert_idle, make_engine, run_to_completion
from lora_runner import SamplingParams
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.core.scheduler_output import Placement
from test_engine_bad_adapters import OFFLINE


class InjectedFault(RuntimeError):
    pass


def make_scheduler(max_tokens=8):
    states = {"A": "ready", "B": "ready"}
    blocks = BlockManager(64, 4)
    return Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=max_tokens, max_loras=2,
                     adapter_state=states.__getitem__), blocks


def make_request(i, prompt_len, lora):
    return Request(f"r{i}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4), arrival=i, lora_ref=lora,
                   tenant=f"t{i}")


def test_requests_without_a_slot_are_left_out_of_the_output_and_handed_back():
    sched, blocks = make_scheduler()
    running, admitted = make_request(0, 12, "A"), make_request(1, 3, "B")
    sched.add(running)
    first = sched.schedule(place=lambda picked: Placement({"A": 0}))
    assert first.scheduled_ids == ["r0"] and first.lora_slots == {"A": 0}
    running.num_computed_tokens += first.num_scheduled_tokens[0]  # what postprocess does
    sched.add(admitted)
    asked, served = [], sched.fairness.counter("t0")

    def place(picked):
        asked.append([(s.request.request_id, s.start, s.num_new_tokens) for s in picked])
        return Placement({"B": 1}, unplaced={running: InjectedFault("slot write")})

    out = sched.schedule(place=place)
    assert asked == [[("r0", 8, 4), ("r1", 0, 3)]]  # batch order: running first, then admitted
    assert out.scheduled_ids == ["r1"] and out.num_scheduled_tokens == [3]
    assert [new.request_id for new in out.new_requests] == ["r1"] and out.continuing == []
    assert out.failed == [running] and isinstance(running.error, InjectedFault)
    assert out.finished_ids == ["r0"]  # its row goes with this output
    assert out.lora_slots == {"B": 1}
    assert running not in sched.running and sched.fairness.counter("t0") == served  # not charged
    sched.remove(running)  # the engine finishes it: its blocks go back
    assert blocks.table("r0") == []
    assert sched.schedule().scheduled_ids == ["r1"]


def test_an_unplaced_admitted_request_has_no_row_to_free():
    sched, _ = make_scheduler()
    request = make_request(0, 3, "A")
    sched.add(request)
    out = sched.schedule(place=lambda picked: Placement(unplaced={request: InjectedFault("no slot")}))
    assert out.scheduled == [] and out.new_requests == [] and out.failed == [request]
    assert out.finished_ids == []  # it never had a row


def _snapshot(sched):
    """Every field of the output as it stands (the live requests by id: their own state moves on)."""
    live = {"scheduled": [(s.request.request_id, s.start, s.num_new_tokens) for s in sched.scheduled],
            "failed": [request.request_id for request in sched.failed]}
    return {field.name: repr(live.get(field.name, getattr(sched, field.name))) for field in dataclasses.fields(sched)}


@pytest.mark.parametrize("fault", ["slot_write", "activate"])
def test_the_engine_never_edits_the_output_after_schedule(engine_checkpoint, monkeypatch, fault):
    """A step whose adapter placement fails (one slot write, or activation as a whole) runs what schedule()
    returned, unchanged: every field of every step's output is the same after the step as when it was made."""
    path, _, adapters = engine_checkpoint
    engine = make_engine(path, **OFFLINE)
    if fault == "slot_write":
        slots, write = engine.adapters.manager.lora_slots, engine.adapters.manager.lora_slots.write

        def failing_write(slot, weights):
            if weights.name == "r8-qv":
                raise InjectedFault("the slot write overflowed")
            write(slot, weights)

        monkeypatch.setattr(slots, "write", failing_write)
    else:
        activate, calls = engine.adapters.activate, []

        def failing_activate(scheduled):
            calls.append(1)
            if len(calls) == 2:
                raise InjectedFault("making the step's adapters resident failed")
            return activate(scheduled)

        monkeypatch.setattr(engine.adapters, "activate", failing_activate)
    schedule, outputs = engine.scheduler.schedule, []

    def recording_schedule(**kwargs):
        out = schedule(**kwargs)
        outputs.append((out, _snapshot(out)))
        return out

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    done = run_to_completion(engine, [("base", [12, 13, 14], params),
                                      ("r4", [5, 6, 7], params, LoRARequest("r4", adapters["r4"][0])),
                                      ("qv", [9, 10], params, LoRARequest("r8-qv", adapters["r8-qv"][0]))])
    assert any(o.outputs[0].finish_reason == "error" for o in done.values())
    assert any(out.failed for out, _ in outputs)
    for out, made in outputs:
        assert _snapshot(out) == made
    assert_idle(engine)
