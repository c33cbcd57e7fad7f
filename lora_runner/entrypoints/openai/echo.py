"""What a choice reports besides its generated text: the echoed prompt and the token ids.

- completions ``echo`` (OpenAI): the prompt's text before the completion in ``text`` and, with
  ``logprobs``, the prompt tokens' entries before the generated ones (the first token's logprob and
  top_logprobs null: nothing predicts it). ``max_tokens=0`` with echo scores the prompt only (what
  lm-evaluation-harness's loglikelihood requests may send): the engine generates one token, which is
  not reported.
- chat ``echo`` (vLLM): the last message's content before the reply when that message is the assistant's.
- ``return_token_ids`` (vLLM): ``prompt_token_ids`` and the generated ``token_ids`` of each choice.
- ``prompt_logprobs=k`` (vLLM): each choice's (completions) or the response's (chat) ``prompt_logprobs``, in
  vLLM's shape: None for the first prompt token, then {token id: {"logprob", "rank", "decoded_token"}} with
  the top k and the prompt token (its rank None when it is not among them: the engine does not rank it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from lora_runner.entrypoints.openai.errors import APIError
from lora_runner.entrypoints.openai.formatting import TokenLogprob
from lora_runner.entrypoints.openai.response_body import ENTRY_JSON_BYTES


@dataclass(frozen=True)
class ChoiceExtras:
    """The request's extras, the same for each of its choices."""

    echo_texts: list[str] | None = None  # per prompt: the text reported before the generated text
    echo_logprobs: bool = False  # the prompt tokens' logprobs first (completions echo with logprobs)
    discard_generated: bool = False  # max_tokens=0 with echo: the token the engine generates is not reported
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N", not by their text
    prompt_logprobs: int | None = None  # vLLM's field: the top k at each prompt position in the response

    def echo_text(self, prompt_index: int) -> str | None:
        """The text echoed before prompt `prompt_index`'s choices (None: no echo)."""
        return None if self.echo_texts is None else self.echo_texts[prompt_index]


def prompt_token_logprobs(token_text: Callable[[int], str], prompt_ids: list[int],
                          prompt_logprobs: list[dict[int, float] | None], k: int) -> list[TokenLogprob]:
    """The prompt tokens' logprobs entries (RequestOutput.prompt_logprobs) as OpenAI's echo reports them:
    the first has no logprob and no alternatives, each later one its logprob and the top k."""
    token_text = cache(token_text)  # the same few tokens come back in many positions' top k
    entries = []
    for token, table in zip(prompt_ids, prompt_logprobs):
        if table is None:
            entries.append(TokenLogprob(token_text(token), None, None))
            continue
        top = sorted(table.items(), key=lambda item: -item[1])[:k]
        entries.append(TokenLogprob(token_text(token), table[token], [(token_text(t), lp) for t, lp in top]))
    return entries


MIN_JSON_LOGPROB = -9999.0  # vLLM's clamp: -inf is no JSON number


def vllm_prompt_logprobs(token_text: Callable[[int], str], prompt_ids: list[int],
                         prompt_logprobs: list[dict[int, float] | None], k: int) -> list[dict | None]:
    """RequestOutput.prompt_logprobs as vLLM's response field: the top k of each position (ranked 1..k)
    and the prompt token there (rank None when it is not among the top k)."""
    token_text = cache(token_text)
    entries: list[dict | None] = []
    for token, table in zip(prompt_ids, prompt_logprobs):
        if table is None:
            entries.append(None)
            continue
        ranked = sorted(table.items(), key=lambda item: -item[1])[:k]
        chosen = {t: rank for rank, (t, _) in enumerate(ranked, start=1)}
        chosen.setdefault(token, None)
        entries.append({str(t): {"logprob": max(table[t], MIN_JSON_LOGPROB), "rank": rank,
                                 "decoded_token": token_text(t)} for t, rank in chosen.items()})
    return entries


def logprob_entries(prompt_lens: list[int], n: int, max_tokens: int, logprobs: int | None, extras: ChoiceExtras,
                    prompt_logprobs_per_choice: bool) -> int:
    """How many logprob entries (a token's logprob or one of its top alternatives) the response may carry:
    the generated tokens' (n x max_tokens x (k+1) per prompt), the echoed prompt's (each choice), and
    vLLM's prompt_logprobs (each choice on completions, once per prompt on chat): what the body sends, known
    before running (what it holds in memory meanwhile is less: ``response_bytes``)."""
    total = 0
    for length in prompt_lens:
        if logprobs is not None:
            total += n * max_tokens * (logprobs + 1)
            if extras.echo_logprobs:
                total += n * length * (logprobs + 1)
        if extras.prompt_logprobs is not None:
            total += (n if prompt_logprobs_per_choice else 1) * length * (extras.prompt_logprobs + 1)
    return total


# a choice's list of logprobs entries points at the echoed prompt's shared entries: one reference each
ENTRY_REFERENCE_BYTES = 8


def response_bytes(prompt_lens: list[int], n: int, max_tokens: int, logprobs: int | None,
                   extras: ChoiceExtras) -> int:
    """The bytes a whole (non-streamed) response's logprobs hold in memory between the end of its generation
    and the end of its body (what ServerState.reserve_response charges): memory held, not bytes sent. Each
    generated entry is its choice's own (n x max_tokens x (k+1) per prompt); a prompt's entries, echoed or
    vLLM's prompt_logprobs, are built once for the prompt (ChoiceRun) and shared by its n choices, so they
    count once, plus one reference per echoed token in each choice's list. The body itself is written a chunk
    at a time from those objects (response_body), so the n copies it sends are never held together; what it
    sends is bounded apart, before running, by ``logprob_entries`` (max_logprob_entries)."""
    entries = references = 0
    for length in prompt_lens:
        if logprobs is not None:
            entries += n * max_tokens * (logprobs + 1)
            if extras.echo_logprobs:
                entries += length * (logprobs + 1)
                references += n * length
        if extras.prompt_logprobs is not None:
            entries += length * (extras.prompt_logprobs + 1)
    return entries * ENTRY_JSON_BYTES + references * ENTRY_REFERENCE_BYTES


def check_logprob_entries(entries: int, limit: int | None) -> None:
    """400 before any work for a request whose response could carry more than `limit` logprob entries
    (ServerConfig.max_logprob_entries; None: unbounded): what its building holds in memory grows with it."""
    if limit is not None and entries > limit:
        raise APIError(400, f"this request could return {entries} logprob entries (prompts x n x tokens x "
                       f"(logprobs + 1), prompt_logprobs included), more than the limit of {limit} "
                       "(--max-logprob-entries): send fewer prompts, a smaller n, max_tokens or logprobs",
                       "too_many_logprobs")
