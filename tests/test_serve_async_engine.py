"""AsyncLLMEngine: routing outputs to asyncio, idle sleep, cancellation, step failures, shutdown."""

import asyncio
import threading
import time

import pytest

from lora_runner import LLMEngine, SamplingParams
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.engine.errors import EngineDeadError


@pytest.fixture
def engine(engine_checkpoint):
    model_dir, _, _ = engine_checkpoint
    async_engine = AsyncLLMEngine(LLMEngine(model_dir, device="cpu", dtype="float32", max_model_len=512))
    yield async_engine
    async_engine.shutdown()


def _count_steps(engine: AsyncLLMEngine) -> list:
    calls, step = [], engine.engine.step

    def counting_step():
        calls.append(time.monotonic())
        return step()

    engine.engine.step = counting_step
    return calls


async def _collect(engine, request_id, prompt, **params):
    return [o async for o in engine.generate(prompt, SamplingParams(temperature=0.0, **params), request_id)]


def test_outputs_reach_their_own_iterators_and_equal_the_sync_engine(engine, engine_checkpoint):
    from lora_runner import LLM

    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    async def main():
        return await asyncio.gather(*(_collect(engine, f"r{i}", p, max_tokens=6) for i, p in enumerate(prompts)))

    results = asyncio.run(main())
    llm = LLM(engine_checkpoint[0], device="cpu", dtype="float32", max_model_len=512)
    try:
        expected = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    finally:
        llm.close()
    for i, outputs in enumerate(results):
        assert all(o.request_id == f"r{i}" for o in outputs)
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
        assert outputs[-1].outputs[0].token_ids == expected[i].outputs[0].token_ids


def test_a_stats_snapshot_is_published_after_every_step(engine):
    snapshots, step = [], engine.engine.step

    def recording_step():
        outputs = step()
        snapshots.append(engine.get_stats())  # on the step thread, before the outputs are dispatched
        return outputs

    engine.engine.step = recording_step
    before = engine.get_stats()
    asyncio.run(_collect(engine, "r", [5, 6, 7], max_tokens=4, ignore_eos=True))
    assert (before.steps, before.running, before.kv_blocks_used) == (0, 0, 0)
    assert before.kv_blocks_total == engine.engine.block_manager.num_blocks
    assert [s.steps for s in snapshots] == list(range(1, len(snapshots) + 1))
    assert snapshots[0].running == 1 and snapshots[0].kv_blocks_used > 0
    assert (snapshots[-1].running, snapshots[-1].waiting, snapshots[-1].kv_blocks_used) == (0, 0, 0)


def test_the_step_thread_sleeps_without_work(engine):
    calls = _count_steps(engine)
    waits, wait = [], engine._wake.wait

    def recording_wait(timeout=None):
        waits.append((timeout, len(calls)))
        return wait(timeout)

    engine._wake.wait = recording_wait
    asyncio.run(_collect(engine, "warm", [5, 6], max_tokens=2))
    settled = len(calls)
    deadline = time.monotonic() + 30
    while not (waits and waits[-1][1] == settled and engine._wake._waiters) and time.monotonic() < deadline:
        time.sleep(0.001)  # until the step thread parks (CPython's Condition keeps its waiters in _waiters)
    # parked in one untimed wait after its last step: only a notify (new work, shutdown) wakes it, so an
    # idle engine is never stepped (a polling loop would wait with a timeout, or step again)
    assert waits[-1] == (None, settled) and len(calls) == settled
    asyncio.run(_collect(engine, "again", [5, 6], max_tokens=2))  # and it wakes up for new work
    assert len(calls) > settled


def test_a_cancelled_iterator_aborts_its_request(engine):
    finished = {}
    step = engine.engine.step

    def recording_step():
        time.sleep(0.002)
        outputs = step()
        finished.update({o.request_id: o for o in outputs if o.finished})
        return outputs

    engine.engine.step = recording_step

    async def main():
        task = asyncio.ensure_future(_collect(engine, "long", [5, 6, 7], max_tokens=400, ignore_eos=True))
        while not engine.engine.block_manager.num_used_blocks:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    deadline = time.monotonic() + 10
    while engine.engine.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert finished["long"].outputs[0].finish_reason == "abort"
    assert engine.engine.block_manager.num_used_blocks == 0 and engine.num_in_flight() == 0


def test_an_exception_in_step_reaches_every_waiting_iterator(engine):
    started = threading.Event()
    step = engine.engine.step

    def failing_step():
        outputs = step()
        if started.is_set():
            raise RuntimeError("device fell over")
        return outputs

    engine.engine.step = failing_step

    async def main():
        tasks = [asyncio.ensure_future(_collect(engine, f"r{i}", [5, 6], max_tokens=300, ignore_eos=True))
                 for i in range(3)]
        await asyncio.sleep(0.05)
        started.set()
        return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "device fell over" in str(r) for r in results)
    assert not engine.is_running and isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineDeadError):
        asyncio.run(_collect(engine, "late", [5], max_tokens=2))


def test_shutdown_ends_waiting_iterators_within_its_bound(engine):
    async def main():
        task = asyncio.ensure_future(_collect(engine, "long", [5, 6], max_tokens=450, ignore_eos=True))
        while not engine.engine.block_manager.num_used_blocks:
            await asyncio.sleep(0.005)
        began = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown, 5.0)
        took = time.monotonic() - began
        result = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=10)
        return took, result[0]

    took, result = asyncio.run(main())
    assert took < 5.0
    # the request was aborted at shutdown: its iterator ends either with the "abort" output or the error
    assert isinstance(result, EngineDeadError) or result[-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running


def test_bad_requests_raise_from_generate_and_leave_the_engine_serving(engine):
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(_collect(engine, "bad", [10_000], max_tokens=2))
    assert engine.num_in_flight() == 0
    assert asyncio.run(_collect(engine, "bad", [5, 6], max_tokens=2))[-1].finished  # the id is free again
