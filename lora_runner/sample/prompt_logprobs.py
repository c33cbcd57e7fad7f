"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's semantics) of the prompt positions in a step.

The logits at position p predict the token at p + 1, so a request whose chunk computes positions
[start, start + len) scores the prompt tokens those positions predict: user prompt token j >= 1 (the
first has no position before it: its entry stays None) is predicted by position num_virtual + j - 1
(soft-prompt placeholders come first and are no prompt token the user sent). Each entry is a dict
token_id -> logprob of the k most likely tokens plus the actual prompt token: log_softmax of the float32
logits, as the generated tokens' logprobs.

Memory: only requests that ask are scored, and in pieces of at most MAX_PROMPT_LOGIT_ROWS positions,
so a long prompt never holds a [prompt, vocab] logits block (a [piece, vocab] one at most).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from punica_kernels import invariant

MAX_PROMPT_LOGIT_ROWS = 256  # most prompt positions whose logits exist at once


@dataclass
class PromptSpan:
    """The prompt positions one request's chunk scores this step."""

    request_id: str
    first: int  # index in the user's prompt of the first token scored (>= 1)
    flat_start: int  # row of the flat batch of the position that predicts it
    targets: np.ndarray  # [n] int64 the prompt tokens scored (what positions flat_start.. predict)
    k: int  # top logprobs per position


@dataclass
class PromptLogprobsChunk:
    """One request's prompt logprobs of one step: entries for prompt tokens first .. first + len - 1."""

    first: int
    entries: list[dict[int, float]]


def prompt_spans(request_ids: Sequence[str | None], token_ids: np.ndarray, rows: np.ndarray, starts: np.ndarray,
                 lens: np.ndarray, prompt_k: np.ndarray, num_virtual: np.ndarray,
                 num_prompt: np.ndarray) -> list[PromptSpan]:
    """The step's spans, one per sequence that asks for prompt logprobs and computes a position
    predicting a prompt token. request_ids: row -> id; token_ids [R, L]: the rows' tokens; rows,
    starts, lens [B]: the step's sequences in batch order; prompt_k, num_virtual, num_prompt [R]: per
    row k (-1: none), placeholders and user prompt length."""
    spans: list[PromptSpan] = []
    wanted = np.flatnonzero(prompt_k[rows] >= 0)  # [W] sequences of the step that ask
    if not wanted.size:
        return spans
    offsets = np.concatenate(([0], np.cumsum(lens)))  # [B + 1] flat row of each sequence's first token
    for i in wanted.tolist():
        row, start = int(rows[i]), int(starts[i])
        virtual = int(num_virtual[row])
        low = max(start, virtual)
        high = min(start + int(lens[i]), virtual + int(num_prompt[row]) - 1)  # the last prompt token predicts none
        if high <= low:
            continue
        spans.append(PromptSpan(request_ids[row], low - virtual + 1, int(offsets[i]) + low - start,
                                token_ids[row, low + 1:high + 1].astype(np.int64), int(prompt_k[row])))
    return spans


def score_spans(hidden: torch.Tensor, spans: Sequence[PromptSpan],
                logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                max_rows: int = MAX_PROMPT_LOGIT_ROWS) -> dict[str, PromptLogprobsChunk]:
    """request id -> its chunk's prompt logprobs. hidden [T, hidden]: the step's final hidden states;
    logits_of(flat_rows [n] int64, hidden_rows [n, hidden]) -> [n, vocab] float32 logits of those rows
    (with each row's lm_head LoRA). Pieces of at most `max_rows` positions; one host transfer each."""
    result: dict[str, PromptLogprobsChunk] = {}
    for span in spans:
        entries: list[dict[int, float]] = []
        for piece in range(0, len(span.targets), max_rows):
            targets = span.targets[piece:piece + max_rows]
            flat = torch.arange(span.flat_start + piece, span.flat_start + piece + len(targets),
                                device=hidden.device)  # [n]
            entries += _entries(logits_of(flat, hidden[flat]), targets, span.k)
        result[span.request_id] = PromptLogprobsChunk(span.first, entries)
    return result


def _entries(logits: torch.Tensor, targets: np.ndarray, k: int) -> list[dict[int, float]]:
    """One dict per row of logits [n, V]: its k best tokens and its target token."""
    logprobs = invariant.softmax(logits.float(), log=True)  # [n, V]; per row in the batch-invariant mode on CUDA
    target_ids = torch.from_numpy(targets).to(logprobs.device)[:, None]  # [n, 1]
    columns = [logprobs.gather(1, target_ids)]  # [n, 1]
    if k:
        top_vals, top_ids = invariant.topk(logprobs, k)  # [n, k]; the batch-invariant mode: lowest id on ties
        columns += [top_vals, top_ids.float()]  # ids below 2**24 are exact in float32
    packed = torch.cat(columns, dim=1).cpu().tolist()  # [n, 1 + 2k]
    entries = []
    for target, row in zip(targets.tolist(), packed):
        entry = {int(token): value for token, value in zip(row[1 + k:], row[1:1 + k])}
        entry[target] = row[0]
        entries.append(entry)
    return entries
