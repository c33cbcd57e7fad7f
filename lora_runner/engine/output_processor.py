"""After the model ran: append each request's sampled tokens, detokenize them, and decide whether it is
finished. This is the one definition of "finished" that the engine, LLM, the server and the tests
share (Scheduler.postprocess calls it for every sampled request of a step).

A request finishes with
- "stop": an EOS id (unless ignore_eos), one of its stop_token_ids (whose text is left out of the
  output unless include_stop_str_in_output, as vLLM), or one of its stop strings in the text (the
  text is cut there, see lora_runner.engine.detokenizer.OutputText); none of these count
  before min_tokens tokens were generated (one rule, shared with the sampler's ban:
  lora_runner.core.stop_rule). stop_reason is the stop string or the stop token id (None for EOS).
- "stop" too: the request's structured-output constraint is complete (its grammar matcher, advanced
  by every token here, accepted an end token: lora_runner.engine.structured), or, while EOS may not
  end it (min_tokens or ignore_eos: StopTokens.eos_allowed, under which its mask leaves EOS out),
  allows nothing but an end token next (vLLM's outcome: the constraint wins over min_tokens).
- "length": max_tokens generated, or the sequence reached max_model_len.

A row may bring several tokens in one step (a list per row, lora_runner.sample.sampler.SamplerOutput):
they are taken in order, each under the rules above at its own position, and a request that finishes
on one of them drops the rest (they are not appended, detokenized or counted).

Each output is cumulative (everything so far) or, with SamplingParams.output_kind DELTA, only what
is new since the request's previous output: then a step costs what it adds, not what the request
holds (the async engine asks for deltas and merges those its consumer has not read yet).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence

from lora_runner.core.request import Request
from lora_runner.core.stop_rule import StopTokens, stop_tokens
from lora_runner.engine.detokenizer import OutputText
from lora_runner.outputs import CompletionOutput
from lora_runner.sample.prompt_logprobs import PromptLogprobsChunk
from lora_runner.sampling_params import RequestOutputKind


class ReportedText(OutputText):
    """A request's OutputText and how many of its output tokens its outputs reported so far."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_reported_tokens = 0


class OutputProcessor:
    """Appends tokens and checks stops. decode: output ids -> text without special tokens (None: no
    text); a request with SamplingParams.skip_special_tokens=False or spaces_between_special_tokens=False
    has its text decoded by ``decode(ids, skip_special_tokens=..., spaces_between_special_tokens=...)``.
    eos_token_ids: the model's end ids; max_model_len: the longest sequence (prompt + output)."""

    def __init__(self, decode: Callable[[list[int]], str] | None, eos_token_ids: Collection[int],
                 max_model_len: int) -> None:
        self.decode = decode
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len

    def append(self, request: Request, token_ids: Sequence[int],
               logprobs: Sequence[dict | None] | None = None) -> str | None:
        """Append a row's sampled tokens (and each one's logprobs dict) in order; returns the finish
        reason, or None to go on. Each token is checked as if it came alone (stop ids and min_tokens
        at its own count, its text against the stop strings, max_tokens and max_model_len, the
        grammar advanced by it); the first that finishes the request ends it, and the tokens after it
        are dropped: not appended, detokenized or counted. Sets request.stop_reason for a stop token
        or stop string. Does not free anything: the caller (Scheduler.postprocess) finishes the
        request. StructuredOutputError for a token the grammar rejects (the tokens before it stay)."""
        for i, token_id in enumerate(token_ids):
            reason = self._append_one(request, token_id, None if logprobs is None else logprobs[i])
            if reason is not None:
                return reason
        return None

    def _append_one(self, request: Request, token_id: int, logprobs: dict | None) -> str | None:
        """Append one token (see append)."""
        request.token_ids.append(token_id)
        if request.logprobs is not None:
            request.logprobs.append(logprobs)
        text = self.text_of(request)
        params = request.params
        # the matcher follows every token (a stop below must not leave it behind); StructuredOutputError
        # for a token its mask did not allow fails this request alone (Scheduler.postprocess)
        if request.grammar is not None and request.grammar.accept(token_id, self.stop_tokens(request).eos_allowed) and \
                not stop_tokens(params, request.num_output_tokens - 1, self.eos_token_ids).stops(token_id):
            text.add(token_id, match_stop=False)
            return "stop"
        # a stop id under the rule it was sampled under (lora_runner.core.stop_rule): the sampling side
        # banned it then, and a token that reaches here anyway must not end the request early either.
        # Checked before stop strings, as vLLM does; its text is part of the output only with
        # include_stop_str_in_output (an EOS decodes to nothing either way: special tokens are skipped)
        if stop_tokens(params, request.num_output_tokens - 1, self.eos_token_ids).stops(token_id):
            if params.include_stop_str_in_output:
                text.add(token_id, match_stop=False)
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
            return "stop"
        # a stop string may end the request once it holds min_tokens tokens, this one included
        matched = text.add(token_id, match_stop=self.stop_tokens(request).may_stop)
        if matched is not None:
            request.stop_reason = matched
            return "stop"
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def append_prompt_logprobs(request: Request, chunk: PromptLogprobsChunk) -> None:
        """Add a step's prompt logprobs to the request's; entries it holds already (a preempted request
        computes its prompt again) are kept."""
        held = request.prompt_logprobs
        if held is None:
            return
        assert chunk.first <= len(held), \
            f"request {request.request_id!r}: prompt logprobs from token {chunk.first}, it holds {len(held)}"
        held.extend(chunk.entries[len(held) - chunk.first:])

    def stop_tokens(self, request: Request) -> StopTokens:
        """The stop rule for the request's next token (lora_runner.core.stop_rule): which ids the
        sampling side bans while it may not stop yet."""
        return stop_tokens(request.params, request.num_output_tokens, self.eos_token_ids)

    def finish(self, request: Request, reason: str) -> str:
        """The request ends with `reason`: its held-back text joins the output. Returns the reason,
        "stop" when that text completes a stop string (then request.stop_reason is set)."""
        text = self.text_of(request)
        matched = text.finish(match_stop=self.stop_tokens(request).may_stop)
        if matched is not None and reason == "length":
            request.stop_reason = matched
            return "stop"
        return reason

    def text_of(self, request: Request) -> ReportedText:
        """The request's OutputText, made on first use."""
        if request.output_text is None:
            params = request.params
            decode = self.decode
            if decode is not None and not (params.skip_special_tokens and params.spaces_between_special_tokens):
                decode = functools.partial(decode, skip_special_tokens=params.skip_special_tokens,
                                           spaces_between_special_tokens=params.spaces_between_special_tokens)
            request.output_text = ReportedText(decode, params.stop, params.include_stop_str_in_output,
                                             params.stop_text_holdback)
        return request.output_text

    def completion(self, request: Request) -> CompletionOutput:
        """The request's CompletionOutput now: everything so far (text_delta: the text not reported
        before) or, for output_kind DELTA, only the tokens, logprobs and text not reported before."""
        text = self.text_of(request)
        delta = text.take_delta()
        if request.params.output_kind is RequestOutputKind.DELTA:
            start = text.num_reported_tokens  # copies only the new tail, never the output so far
            token_ids = request.token_ids[request.num_tokens - request.num_output_tokens + start:]
            logprobs = request.logprobs[start:] if request.logprobs is not None else None
            text.num_reported_tokens += len(token_ids)
            reported = delta
        else:
            token_ids, reported = request.output_token_ids, text.reportable
            logprobs = list(request.logprobs) if request.logprobs is not None else None
        return CompletionOutput(index=0, token_ids=token_ids, text=reported, text_delta=delta,
                                finish_reason=request.finish_reason, logprobs=logprobs, error=request.error,
                                stop_reason=request.stop_reason)
