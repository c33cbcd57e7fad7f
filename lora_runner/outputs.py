"""What the engine hands back for a request: its tokens, text and why it stopped."""

from __future__ import annotations

from dataclasses import dataclass, field


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


@dataclass
class RequestOutput:
    """The state of one request after a step: prompt ids and its completions so far.

    num_cached_tokens: prompt tokens whose KV the request did not compute at its first admission
    (served from the prefix cache, or shared with sample 0 of its prompt when n > 1), as in vLLM;
    soft-prompt placeholders are not counted.
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt: str | None = None
    num_cached_tokens: int = 0

    @property
    def error(self) -> BaseException | None:
        """The exception that failed this request (finish_reason "error"), else None."""
        return self.outputs[0].error if self.outputs else None
