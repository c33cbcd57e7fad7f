"""LoadExecutor's claim: a runtime load publishes its adapter only while its caller still waits."""

import asyncio
import threading

import pytest

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.load_executor import LoadExecutor

DEADLINE_S = 0.05


def test_a_load_that_claimed_is_waited_for_past_the_deadline():
    async def main():
        publishing = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.call_later(4 * DEADLINE_S, publishing.set)  # after the deadline fired (same loop's timers)
        ended = threading.Event()

        def load(claim):
            assert claim()  # the caller still waits: from here on it waits for the result
            asyncio.run_coroutine_threadsafe(publishing.wait(), loop).result()
            ended.set()
            return "served"

        result = await LoadExecutor(2, 1, DEADLINE_S).run("t", load)
        return result, ended.is_set()

    assert asyncio.run(main()) == ("served", True)


def test_a_load_past_its_deadline_cannot_claim_and_its_caller_got_504():
    answered, claims, ended = threading.Event(), [], threading.Event()

    def load(claim):
        answered.wait(10)  # still reading when the caller got its 504
        claims.append(claim())
        ended.set()
        return "served"

    async def main():
        loads = LoadExecutor(2, 1, DEADLINE_S)
        with pytest.raises(APIError) as info:
            await loads.run("t", load)
        answered.set()
        return info.value.status

    assert asyncio.run(main()) == 504
    assert ended.wait(10) and claims == [False]
