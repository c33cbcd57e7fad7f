"""After the model ran: append each request's sampled token, detokenize it, and decide whether it is
finished. This is the one definition of "finished" that the engine, LLM, the server and the tests
share (Scheduler.postprocess calls it for every sampled request of a step).

A request finishes with
- "stop": an EOS id (unless ignore_eos), one of its stop_token_ids, or one of its stop strings in
  the text (the text is cut there, see lora_runner.engine.detokenizer.OutputText); none of these count
  before min_tokens tokens were generated. stop_reason is the stop string or the stop token id
  (None for EOS).
- "length": max_tokens generated, or the sequence reached max_model_len.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from lora_runner.engine.detokenizer import OutputText
from lora_runner.outputs import CompletionOutput
from lora_runner.core.request import Request


class OutputProcessor:
    """Appends tokens and checks stops. decode: output ids -> text without special tokens (None: no
    text); eos_token_ids: the model's end ids; max_model_len: the longest sequence (prompt + output)."""

    def __init__(self, decode: Callable[[list[int]], str] | None, eos_token_ids: Collection[int],
                 max_model_len: int) -> None:
        self.decode = decode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, request: Request, token_id: int, logprobs: dict | None = None) -> str | None:
        """Append one sampled token (and its logprobs); returns the finish reason, or None to go on.
        Sets request.stop_reason for a stop token or stop string. Does not free anything: the caller
        (Scheduler.postprocess) finishes the request."""
        request.token_ids.append(token_id)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        text = self.text_of(request)
        params = request.params
        may_stop = request.num_output_tokens >= params.min_tokens
        matched = text.add(token_id, match_stop=may_stop)
        if matched is not None:
            request.stop_reason = matched
            return "stop"
        if may_stop and token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return "stop"
        if may_stop and token_id in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, request: Request, reason: str) -> str:
        """The request ends with `reason`: its held-back text joins the output. Returns the reason,
        "stop" when that text completes a stop string (then request.stop_reason is set)."""
        text = self.text_of(request)
        matched = text.finish(match_stop=request.num_output_tokens >= request.params.min_tokens)
        if matched is not None and reason == "length":
            request.stop_reason = matched
            return "stop"
        return reason

    def text_of(self, request: Request) -> OutputText:
        """The request's OutputText, made on first use."""
        if request.output_text is None:
            params = request.params
            request.output_text = OutputText(self.decode, params.stop, params.include_stop_str_in_output,
                                             params.stop_text_holdback)
        return request.output_text

    def completion(self, request: Request) -> CompletionOutput:
        """The request's CompletionOutput now: full text so far and the text not reported before."""
        text = self.text_of(request)
        delta = text.take_delta()
        return CompletionOutput(index=0, token_ids=request.output_token_ids, text=text.reportable,
                                text_delta=delta, finish_reason=request.finish_reason,
                                logprobs=list(request.logprobs) if request.logprobs is not None else None,
                                error=request.error, stop_reason=request.stop_reason)
