"""Parallel sampling (SamplingParams.n > 1): one request fanned out into n samples, reported as one.

LLMEngine.add_request turns a request with n > 1 into n sample requests with ids
``f"{request_id}[{i}]"`` and params ``params.sample_params(i)`` (n=1, seed + i). Sample 0 leads:
the scheduler admits the others once it has computed the prompt, and they share its full prompt
KV blocks (Scheduler.add, BlockManager.fork). Each step the samples' outputs are merged into one
RequestOutput under the caller's id, with one CompletionOutput per sample (index 0..n-1); it is
finished when every sample is.
"""

from __future__ import annotations

import dataclasses

from lora_runner.core.request import Request
from lora_runner.outputs import CompletionOutput, RequestOutput
from lora_runner.sampling_params import RequestOutputKind


def sample_ids(request_id: str, n: int) -> list[str]:
    """The internal ids of a request's samples: the id itself when n == 1."""
    return [request_id] if n == 1 else [f"{request_id}[{i}]" for i in range(n)]


class SampleGroup:
    """The n sample requests of one caller request and their latest outputs."""

    def __init__(self, request_id: str, samples: list[Request]) -> None:
        self.request_id = request_id
        self.samples = samples
        self._latest: list[CompletionOutput] = [CompletionOutput(index=i, token_ids=[]) for i in range(len(samples))]
        self._prompt: tuple[list[int], str | None] = (samples[0].prompt_token_ids, samples[0].prompt)
        self._fresh: set[int] = set()  # samples with an output since the last merged one

    def leader_of(self, request: Request) -> Request | None:
        """Sample 0 for the other samples, None for sample 0 itself."""
        return None if request is self.samples[0] else self.samples[0]

    def update(self, index: int, output: RequestOutput) -> None:
        """Record sample `index`'s output of this step."""
        self._latest[index] = dataclasses.replace(output.outputs[0], index=index)
        self._fresh.add(index)

    @property
    def finished(self) -> bool:
        """True once every sample has finished."""
        return all(completion.finished for completion in self._latest)

    def output(self) -> RequestOutput:
        """The caller's RequestOutput: every sample's latest completion, in index order."""
        prompt_token_ids, prompt = self._prompt
        # a sample that made no progress this step gained nothing: never repeat its last delta
        delta = self.samples[0].params.output_kind is RequestOutputKind.DELTA
        completions = [c if i in self._fresh else _unchanged(c, delta) for i, c in enumerate(self._latest)]
        self._fresh.clear()
        # the prompt's cached tokens and prompt logprobs are sample 0's: the others share its prompt blocks
        return RequestOutput(self.request_id, prompt_token_ids, completions, finished=self.finished,
                             prompt=prompt, num_cached_tokens=self.samples[0].num_cached_tokens,
                             prompt_logprobs=self.samples[0].prompt_logprobs,
                             lora_version=self.samples[0].adapter_versions[0],
                             prompt_adapter_version=self.samples[0].adapter_versions[1])


def _unchanged(completion: CompletionOutput, delta: bool) -> CompletionOutput:
    """A sample's output in a step it made no progress in: its state, nothing new."""
    if not delta:
        return dataclasses.replace(completion, text_delta="")
    logprobs = None if completion.logprobs is None else []
    return dataclasses.replace(completion, token_ids=[], text="", text_delta="", logprobs=logprobs)


def merge_outputs(outputs: list[RequestOutput], sample_of: dict[str, tuple[SampleGroup, int]]) -> list[RequestOutput]:
    """The step's outputs with each group's sample outputs replaced by one merged output, placed where
    its first sample's output was."""
    merged: list[RequestOutput] = []
    touched: dict[int, SampleGroup] = {}
    for output in outputs:
        entry = sample_of.get(output.request_id)
        if entry is None:
            merged.append(output)
            continue
        group, index = entry
        group.update(index, output)
        if id(group) not in touched:
            touched[id(group)] = group
            merged.append(group)  # placeholder, replaced below once every sample of the step is in
    return [item.output() if isinstance(item, SampleGroup) else item for item in merged]
