"""What the engine hands back for a request: its tokens, text and why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from lora_runner.request_times import RequestTimes

# What one generated token costs in memory, roughly (measured with tracemalloc on CPython 3.x): its
# id in a list, and its logprobs dict (a dict of k + 1 int -> float entries). Used to bound what a
# slow consumer's pending output may hold (AsyncLLMEngine's max_pending_output_bytes), not for accounting.
TOKEN_NBYTES = 36
LOGPROBS_DICT_NBYTES = 232
LOGPROB_ENTRY_NBYTES = 76


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_model_len), "abort"
    (abort_request), "error" (the request failed: its adapter could not be loaded, its logits were
    NaN/inf (lora_runner.sample.sampler.NonFiniteLogitsError), or its own sampling, detokenization or
    soft-prompt placeholders raised; the exception is in `error`, other requests are unaffected),
    or None while the request is still running.
    logprobs: when SamplingParams.logprobs is set, one dict token_id -> logprob per generated token,
    always containing the chosen token.
    text: the output text so far (cut at a stop string; while stop strings are set and the request
    runs, without its last characters, which a stop string may still cut). text_delta: the part of
    `text` not in the previous output of this request (deltas concatenate to the final text).
    stop_reason: the stop string or stop token id that finished the request (None for EOS and
    every other finish_reason).
    """

    index: int
    token_ids: list[int]
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    error: BaseException | None = None
    text_delta: str = ""
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """True once a finish_reason is set."""
        return self.finish_reason is not None

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the chosen tokens' logprobs (vLLM's field); None without logprobs, as in vLLM v1.
        For a DELTA output, the sum over the tokens it holds."""
        if self.logprobs is None:
            return None
        return sum(table[token] for token, table in zip(self.token_ids, self.logprobs))

    def add(self, later: CompletionOutput, aggregate: bool) -> None:
        """Fold this sequence's `later` output into this one, in place (vLLM's RequestOutput.add).

        aggregate=True: `later` is a delta (output_kind DELTA): its tokens, logprobs and text are
        appended. aggregate=False: `later` is cumulative and replaces them. Either way the text
        deltas concatenate and the finish state is `later`'s."""
        if aggregate:
            self.token_ids.extend(later.token_ids)
            if later.logprobs is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(later.logprobs)
            self.text += later.text
        else:
            self.token_ids, self.text, self.logprobs = later.token_ids, later.text, later.logprobs
        self.text_delta += later.text_delta
        self.finish_reason, self.error, self.stop_reason = later.finish_reason, later.error, later.stop_reason

    def copy(self) -> CompletionOutput:
        """A copy with its own token and logprob lists (the dicts inside are shared: nobody changes them)."""
        logprobs = None if self.logprobs is None else list(self.logprobs)
        return replace(self, token_ids=list(self.token_ids), logprobs=logprobs)

    def approx_nbytes(self) -> int:
        """Roughly the memory its tokens, logprobs and text hold (see TOKEN_NBYTES)."""
        logprobs = self.logprobs or ()
        return (TOKEN_NBYTES * len(self.token_ids) + LOGPROBS_DICT_NBYTES * len(logprobs)
                + LOGPROB_ENTRY_NBYTES * sum(len(table) for table in logprobs) + len(self.text) + len(self.text_delta))


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counters, as vLLM's SpecDecodingStats: verify steps (num_drafts), draft
    tokens verified, of those accepted, and accepted per draft position (index j: steps whose first
    j + 1 drafts were accepted)."""

    num_speculative_tokens: int = 0  # k: the length of accepted_per_position
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted_per_position = self.accepted_per_position or [0] * self.num_speculative_tokens

    def add(self, num_draft_tokens: int, num_accepted: int) -> None:
        """One verify step: `num_draft_tokens` drafts, the first `num_accepted` of them accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if num_accepted > len(self.accepted_per_position):
            self.accepted_per_position += [0] * (num_accepted - len(self.accepted_per_position))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1


@dataclass
class RequestOutput:
    """The state of one request after a step: prompt ids and its completions so far.

    num_cached_tokens: prompt tokens whose KV the request did not compute at its first admission
    (served from the prefix cache, or shared with sample 0 of its prompt when n > 1), as in vLLM;
    soft-prompt placeholders are not counted.
    prompt_logprobs: with SamplingParams.prompt_logprobs set, one entry per prompt token (vLLM's shape):
    None for the first, then a dict token_id -> logprob of the top k plus the actual prompt token
    (log_softmax of the float32 logits at the position before it); None otherwise. Complete in every
    output of the request (no prompt token is generated after its first output).
    metrics: when the request arrived, was first scheduled and got its first and latest tokens (None for
    the merged output of n > 1 samples).
    lora_version / prompt_adapter_version: the adapter version the request ran with (an
    ``adapters.AdapterRef``: ``name`` and ``version``, a number its tier never reuses), from its
    admission to its end, or None without one: which policy produced these tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestTimes | None = None  # vLLM's field: a copy of the request's timestamps at this output
    lora_version: Any = None  # adapters.AdapterRef it ran with (outputs does not import adapters)
    prompt_adapter_version: Any = None  # adapters.AdapterRef of its prompt adapter
    # speculative decoding's counters of the request so far (a copy); None when it is off (or for n > 1 merged)
    spec_decode: SpecDecodingStats | None = None

    @property
    def error(self) -> BaseException | None:
        """The exception that failed this request (finish_reason "error"), else None."""
        return self.outputs[0].error if self.outputs else None

    def add(self, later: RequestOutput, aggregate: bool) -> None:
        """Fold the request's `later` output into this one, in place: each completion by its index
        (CompletionOutput.add), the finished flag and cached-token count `later`'s. aggregate: `later` is a delta."""
        by_index = {completion.index: completion for completion in self.outputs}
        for completion in later.outputs:
            mine = by_index.get(completion.index)
            if mine is None:
                self.outputs.append(completion.copy())
            else:
                mine.add(completion, aggregate)
        self.outputs.sort(key=lambda completion: completion.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = later.prompt_logprobs
        self.metrics = later.metrics if later.metrics is not None else self.metrics
        self.lora_version, self.prompt_adapter_version = later.lora_version, later.prompt_adapter_version

    def copy(self) -> RequestOutput:
        """A copy whose completions have their own lists (what ``add`` may extend)."""
        return replace(self, outputs=[completion.copy() for completion in self.outputs])

    def approx_nbytes(self, prompt_logprobs: bool = True) -> int:
        """Roughly the memory its completions (CompletionOutput.approx_nbytes) and, with
        `prompt_logprobs`, its prompt logprobs hold (approx_prompt_logprobs_nbytes)."""
        completions = sum(completion.approx_nbytes() for completion in self.outputs)
        return completions + (self.approx_prompt_logprobs_nbytes() if prompt_logprobs else 0)

    def approx_prompt_logprobs_nbytes(self) -> int:
        """Roughly the memory its prompt logprobs hold: one dict per prompt token after the first, each
        of about the size of the first (the top k, and the prompt token when it is not among them), so
        that the estimate costs O(1) however long the prompt (it is asked for at every step)."""
        tables = self.prompt_logprobs
        if not tables:
            return 0
        sample = next((table for table in tables[:2] if table is not None), None)  # entry 0 is None
        if sample is None:
            return 0
        return (len(tables) - 1) * (LOGPROBS_DICT_NBYTES + LOGPROB_ENTRY_NBYTES * len(sample))

    @staticmethod
    def approx_token_nbytes(logprobs: int | None) -> int:
        """Roughly what one generated token with `logprobs` top entries adds to an output."""
        if logprobs is None:
            return TOKEN_NBYTES
        return TOKEN_NBYTES + LOGPROBS_DICT_NBYTES + LOGPROB_ENTRY_NBYTES * (logprobs + 1)
