"""What a tensor-parallel step brings back: every rank's SamplerOutput, pickled, with a token list per
row; rank 0's is the step's, and ranks that disagree on any token of any row stop the executor."""

import pickle
from types import SimpleNamespace

import pytest

from lora_runner.core.scheduler_output import SchedulerOutput
from lora_runner.executor.errors import EngineDeadError
from lora_runner.executor.ranked import RankedExecutor
from lora_runner.sample.sampler import SamplerOutput


class FakeRanks(RankedExecutor):
    """Ranks that reply with given SamplerOutputs, through pickle as the worker processes do."""

    def __init__(self, replies: list[SamplerOutput]) -> None:
        super().__init__(SimpleNamespace(eos_token_ids=()), world_size=len(replies))
        self.replies, self.closed = replies, False

    def _deliver(self, payload: bytes) -> list:
        return [pickle.loads(pickle.dumps(reply)) for reply in self.replies]

    def close(self) -> None:
        self.closed = True


def rows(*token_lists, error=None):
    return SamplerOutput([list(t) for t in token_lists], [[{t: -1.0} for t in tokens] for tokens in token_lists],
                         [None] * (len(token_lists) - 1) + [error])


def test_rank_0s_token_lists_come_back_when_every_rank_agrees():
    error = FloatingPointError("last row")
    executor = FakeRanks([rows([5, 6, 7], [8], [], error=error)] * 2)
    result = executor.execute(SchedulerOutput())
    assert result.sampled_token_ids == [[5, 6, 7], [8], []]
    assert result.sampled_logprobs[0] == [{5: -1.0}, {6: -1.0}, {7: -1.0}] and str(result.errors[2]) == "last row"


def test_ranks_that_disagree_on_a_later_token_of_a_row_stop_the_executor():
    executor = FakeRanks([rows([5, 6, 7], [8]), rows([5, 6, 9], [8])])
    with pytest.raises(EngineDeadError, match="out of step") as first:
        executor.execute(SchedulerOutput())
    assert executor.closed
    with pytest.raises(EngineDeadError) as again:  # dead for good: no step reaches the ranks any more
        executor.execute(SchedulerOutput())
    assert again.value is first.value
