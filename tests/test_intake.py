"""Intake (lora_runner.engine.intake) without a model: ids in use, aborts that hold request objects,
n > 1 groups, close, and wait_for_work woken by each kind of event (threads and events, no clocks)."""

import threading
import time

import pytest

from lora_runner import EngineClosedError
from lora_runner.core.request import Request
from lora_runner.engine.intake import Intake
from lora_runner.engine.parallel_sampling import sample_ids
from lora_runner.outputs import CompletionOutput, RequestOutput
from lora_runner.sampling_params import SamplingParams

WAIT_S = 30.0  # bounds every wait below: a test that needs it has failed already


def make_request(request_id, arrival=0):
    return Request(request_id, [5, 6, 7], SamplingParams(max_tokens=2), arrival=arrival)


def add(intake, request_id, n=1):
    """Queue a request with n samples; returns them."""
    samples = [make_request(i, arrival=k) for k, i in enumerate(sample_ids(request_id, n))]
    with intake.adding(request_id, samples):
        pass
    return samples


def output(request_id, finished, token_ids=()):
    completion = CompletionOutput(index=0, token_ids=list(token_ids), finish_reason="length" if finished else None)
    return RequestOutput(request_id, [5, 6, 7], [completion], finished=finished)


def idle_step(intake):
    """What a step that found nothing to run tells the intake."""
    intake.step_ended(intake.step_began())


def test_add_take_finish_frees_the_id():
    intake = Intake()
    (request,) = add(intake, "x")
    assert intake.has_unfinished() and intake.in_use("x") and intake.live("x") is request
    with pytest.raises(ValueError, match="'x' is already in use"):
        add(intake, "x")
    new, aborts = intake.take()
    assert new == [(request, None)] and aborts == []
    assert intake.take() == ([], [])  # taken once
    intake.finished(request)
    assert not intake.has_unfinished() and not intake.in_use("x") and intake.live("x") is None
    add(intake, "x")  # a finished id may be reused


def test_an_id_being_added_is_in_use_but_not_abortable_and_a_failed_add_frees_it():
    intake = Intake()
    request = make_request("x")
    with pytest.raises(RuntimeError, match="adapter load refused"):
        with intake.adding("x", [request]):
            assert intake.in_use("x") and not intake.has_unfinished()
            with pytest.raises(ValueError, match="already in use"):
                add(intake, "x")
            intake.abort(["x"])  # not live yet: nothing to abort
            raise RuntimeError("adapter load refused")
    assert not intake.in_use("x") and intake.take() == ([], [])  # nothing queued, no abort either
    add(intake, "x")


def test_abort_holds_the_request_so_a_reused_id_is_never_hit():
    intake = Intake()
    (first,) = add(intake, "x")
    intake.take()
    intake.abort(["x", "unknown"])  # asked while "x" finishes in the step
    intake.finished(first)
    (second,) = add(intake, "x")
    new, aborts = intake.take()
    assert [r for r, _ in new] == [second]
    assert len(aborts) == 1 and aborts[0] is first  # the engine skips it: it finished already
    intake.finished(first)  # a stale report of the old request leaves the new one live
    assert intake.live("x") is second and intake.has_unfinished()


def test_a_group_takes_its_samples_ids_aborts_together_and_merges_into_one_output():
    intake = Intake()
    samples = add(intake, "g", n=3)
    assert all(intake.in_use(i) for i in ("g", "g[0]", "g[1]", "g[2]"))
    with pytest.raises(ValueError, match=r"'g\[1\]' is already in use \(or one of its sample ids"):
        add(intake, "g[1]", n=2)  # its sample ids would be g[1][0], g[1][1]: "g[1]" itself is taken
    with pytest.raises(ValueError, match="'g' is already in use"):
        add(intake, "g")
    new, _ = intake.take()
    assert new == [(samples[0], None), (samples[1], samples[0]), (samples[2], samples[0])]  # sample 0 leads

    intake.abort(["g"])
    assert intake.take()[1] == samples
    merged = intake.merge_samples([output("g[1]", False, [9]), output("other", True)])
    assert [o.request_id for o in merged] == ["g", "other"] and len(merged[0].outputs) == 3
    for request in samples:
        intake.finished(request)
    assert intake.in_use("g")  # until its merged output finished
    merged = intake.merge_samples([output(f"g[{i}]", True) for i in range(3)])
    assert [(o.request_id, o.finished) for o in merged] == [("g", True)]
    assert not any(intake.in_use(i) for i in ("g", "g[0]", "g[1]", "g[2]"))
    add(intake, "g", n=2)


def test_close_refuses_new_requests():
    intake = Intake()
    intake.check_open()
    intake.close()
    with pytest.raises(EngineClosedError, match="closed"):
        intake.check_open()
    with pytest.raises(EngineClosedError):
        add(intake, "x")
    assert not intake.in_use("x")


def test_wait_for_work_returns_at_once_unless_the_last_step_was_idle():
    intake = Intake()
    assert intake.wait_for_work(timeout=0)  # no step yet
    idle_step(intake)
    assert not intake.wait_for_work(timeout=0)
    intake.step_ended(None)  # a step that ran something
    assert intake.wait_for_work(timeout=0)


def test_a_wake_before_the_idle_step_began_does_not_count():
    intake = Intake()
    add(intake, "x")  # wakes; the step below takes it and still finds nothing to run
    idle_step(intake)
    assert not intake.wait_for_work(timeout=0)


def test_a_wake_while_the_idle_step_ran_counts():
    intake = Intake()
    began = intake.step_began()
    intake.wake()  # an adapter load finished after the step looked at the waiting requests
    intake.step_ended(began)
    assert intake.wait_for_work(timeout=0)


def _blocked_in_wait(intake, thread):
    """Wait until `thread` sleeps on the intake's condition (CPython keeps its waiters in _waiters)."""
    deadline = time.monotonic() + WAIT_S
    while not intake._work._waiters:  # noqa: SLF001 - the test must know the waiter sleeps
        assert thread.is_alive() and time.monotonic() < deadline, "wait_for_work never blocked"
        time.sleep(0.001)


WAKERS = {
    "add": lambda intake, live: add(intake, "new"),
    "abort": lambda intake, live: intake.abort([live.request_id]),
    "adapter load done": lambda intake, live: intake.wake(),  # LLMEngine passes wake as on_load_done
    "close": lambda intake, live: intake.close(),
}


@pytest.mark.parametrize("event", list(WAKERS))
def test_wait_for_work_wakes_on(event):
    intake = Intake()
    (live,) = add(intake, "waiting-for-its-lora")
    intake.take()
    idle_step(intake)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(intake.wait_for_work(timeout=WAIT_S)))
    waiter.start()
    _blocked_in_wait(intake, waiter)
    assert woke == []
    WAKERS[event](intake, live)
    waiter.join(timeout=WAIT_S / 3)  # a wake that forgets to notify leaves the waiter asleep past this
    assert not waiter.is_alive() and woke == [True]
