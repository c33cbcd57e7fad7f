"""Sampling settings in per-row arrays, written once when a request gets its row (vLLM v1's SamplingStates).

The runner keeps each running request in a fixed row (lora_runner.worker.request_rows.InputBatch). When
a request is placed in a row, ``SamplingState.add_request`` writes its settings into the same row of
these arrays, once: temperature, top-k, top-p, the greedy flag, its own generator (seeded requests),
its logprob count, its penalties, its logit bias, min_tokens with the ids banned until then (its stop
ids, from the one stop rule lora_runner.core.stop_rule), and where its prompt lies among the row's token ids.

Each step ``batch(rows, token_ids, num_tokens)`` indexes the arrays by the step's sampled rows and
derives what changes per step from the row's token count alone: the min_tokens ban (its generated
count against min_tokens), the bad-word bans and the penalty histories (views of the row's token
ids, no copy). A speculating row is sampled at each of its verified positions: position j reads
the row's tokens and its first j draft tokens (written after them) as if they were generated, so
the settings at every position are those plain decoding would have there (``offsets``).
``explicit_batch`` builds the same SamplingBatch from per-row lists (memory profile, tests).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lora_runner.core.stop_rule import stop_tokens
from lora_runner.sample.penalties import History
from lora_runner.sample.token_masks import bad_word_bans
from lora_runner.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The settings of one step's S sampled rows (row i = the i-th sampled sequence of the batch)."""

    temperature: np.ndarray  # [S] float32, 1.0 for greedy rows (never divides there)
    top_k: np.ndarray  # [S] int64, the vocabulary size when off
    top_p: np.ndarray  # [S] float32
    greedy: np.ndarray  # [S] bool
    num_logprobs: np.ndarray  # [S] int64, -1: no logprobs
    presence_penalty: np.ndarray  # [S] float32
    frequency_penalty: np.ndarray  # [S] float32
    repetition_penalty: np.ndarray  # [S] float32
    has_penalties: np.ndarray  # [S] bool
    # (row, its generator) of the random rows with their own generator, rows ascending
    seeded: list[tuple[int, torch.Generator]] = field(default_factory=list)
    histories: dict[int, History] = field(default_factory=dict)  # row -> its history, for penalised rows
    ban_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [N] row of each banned id
    ban_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [N] token ids it may not sample
    errors: dict[int, BaseException] = field(default_factory=dict)  # row -> why its settings are unusable
    min_p: np.ndarray | None = None  # [S] float32; None: 0 (off) for every row
    allowed: dict[int, np.ndarray] = field(default_factory=dict)  # row -> the only ids it may sample (int64)
    # row -> (token ids [B] int64, the biases added to their logits [B] float32): SamplingParams.logit_bias
    bias: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # structured outputs (lora_runner.engine.structured): the constrained rows and their packed bitmasks
    grammar_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [C]
    grammar_bitmask: torch.Tensor | None = None  # [C, ceil(V / 32)] int32; None: no row is constrained

    @property
    def num_rows(self) -> int:
        """S."""
        return int(self.temperature.shape[0])

    def history(self, row: int) -> History:
        """Row `row`'s (prompt, generated) token ids; ValueError when none were given."""
        entry = self.histories.get(row)
        if entry is None:
            raise ValueError(f"row {row} has penalties but its prompt/generated token ids were not given")
        return entry

    def row(self, row: int) -> SamplingBatch:
        """The one-row batch of row `row` (the sampler's one-at-a-time fallback)."""
        one = slice(row, row + 1)
        banned = self.ban_rows == row  # [N]
        constrained = np.flatnonzero(self.grammar_rows == row)  # [0] or [1]
        return SamplingBatch(
            self.temperature[one], self.top_k[one], self.top_p[one], self.greedy[one], self.num_logprobs[one],
            self.presence_penalty[one], self.frequency_penalty[one], self.repetition_penalty[one],
            self.has_penalties[one], seeded=[(0, g) for r, g in self.seeded if r == row],
            histories={0: self.histories[row]} if row in self.histories else {},
            ban_rows=np.zeros(int(banned.sum()), np.int64), ban_ids=self.ban_ids[banned],
            errors={0: self.errors[row]} if row in self.errors else {},
            min_p=None if self.min_p is None else self.min_p[one],
            allowed={0: self.allowed[row]} if row in self.allowed else {},
            bias={0: self.bias[row]} if row in self.bias else {},
            grammar_rows=np.zeros(len(constrained), np.int64),
            grammar_bitmask=self.grammar_bitmask[constrained] if constrained.size else None)


    def select(self, index: np.ndarray) -> SamplingBatch:
        """The batch whose row i is row index[i] of this one ([N] int64; a subset, such as the rejection
        sampler's one-sequence retry, or rows repeated: an explicit batch's sequence verified at each
        of its positions with the same settings, where the engine's rows give each position its own)."""
        index = np.asarray(index, np.int64)
        new_of = {old: np.flatnonzero(index == old) for old in np.unique(index).tolist()}  # old row -> new rows
        ban_new, ban_at = np.nonzero(index[:, None] == self.ban_rows[None, :])  # [N'] new row, its ban entry
        constrained = [(i, j) for j, old in enumerate(self.grammar_rows.tolist()) for i in new_of.get(old, ())]
        constrained.sort()

        def remap(entries: dict) -> dict:
            return {int(i): value for old, value in entries.items() for i in new_of.get(old, ())}

        return SamplingBatch(
            self.temperature[index], self.top_k[index], self.top_p[index], self.greedy[index],
            self.num_logprobs[index], self.presence_penalty[index], self.frequency_penalty[index],
            self.repetition_penalty[index], self.has_penalties[index],
            seeded=sorted(remap(dict(self.seeded)).items()), histories=remap(self.histories),
            ban_rows=ban_new.astype(np.int64), ban_ids=self.ban_ids[ban_at], errors=remap(self.errors),
            min_p=None if self.min_p is None else self.min_p[index], allowed=remap(self.allowed),
            bias=remap(self.bias),
            grammar_rows=np.asarray([i for i, _ in constrained], np.int64),
            grammar_bitmask=(self.grammar_bitmask[[j for _, j in constrained]]
                             if self.grammar_bitmask is not None and constrained else None))


class SamplingState:
    """Sampling settings of the runner's request rows (see the module docstring).

    Args:
        max_num_seqs: rows (the InputBatch's).
        vocab_size: top-k at or above it means off.
        eos_token_ids: the model's end ids, banned with a request's stop_token_ids until min_tokens
            (unless ignore_eos); settable (``eos_token_ids``).
    """

    def __init__(self, *, max_num_seqs: int, vocab_size: int, eos_token_ids: Collection[int] = ()) -> None:
        self.vocab_size = vocab_size
        rows = max_num_seqs
        self.temperature = np.ones(rows, np.float32)  # [R]
        self.top_k = np.full(rows, vocab_size, np.int64)  # [R]
        self.top_p = np.ones(rows, np.float32)  # [R]
        self.min_p = np.zeros(rows, np.float32)  # [R]
        self.greedy = np.ones(rows, bool)  # [R]
        self.num_logprobs = np.full(rows, -1, np.int64)  # [R]
        self.presence_penalty = np.zeros(rows, np.float32)  # [R]
        self.frequency_penalty = np.zeros(rows, np.float32)  # [R]
        self.repetition_penalty = np.ones(rows, np.float32)  # [R]
        self.has_penalties = np.zeros(rows, bool)  # [R]
        self.min_tokens = np.zeros(rows, np.int64)  # [R]
        self.prompt_start = np.zeros(rows, np.int64)  # [R] first prompt token (after soft-prompt placeholders)
        self.prompt_end = np.zeros(rows, np.int64)  # [R] first generated token
        self.stop_ids = np.full((rows, 0), -1, np.int64)  # [R, K] sorted stop ids, -1 padded; widened on demand
        self.has_generator = np.zeros(rows, bool)  # [R]
        self.generators: list[torch.Generator | None] = [None] * rows
        self.params: list[SamplingParams | None] = [None] * rows  # to re-derive stop ids when the EOS ids change
        self.errors: list[BaseException | None] = [None] * rows  # why a row's settings could not be written
        self.has_error = np.zeros(rows, bool)  # [R]
        self.allowed: dict[int, np.ndarray] = {}  # row -> its allowed_token_ids (sorted int64), rows that set them
        self.bad_words: dict[int, list[list[int]]] = {}  # row -> its bad words' token sequences
        self.bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # row -> its logit_bias (ids, values)
        self._eos_token_ids = frozenset(eos_token_ids)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's end ids the stop ids include."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Collection[int]) -> None:
        """New EOS ids: the stop ids of every held row are derived again, so running requests ban the
        new ids from their next step on, as the output processor stops on them from then on. Not to
        be called while a step runs."""
        self._eos_token_ids = frozenset(ids)
        for row, params in enumerate(self.params):
            if params is not None:
                self._write_stop_ids(row, params)

    def add_request(self, row: int, params: SamplingParams, generator: torch.Generator | None = None, *,
                    num_prompt_tokens: int = 0, prompt_start: int = 0) -> None:
        """Write every setting of row `row` (whatever held it before is overwritten).

        generator: the request's own (seeded) generator, None: the sampler's. num_prompt_tokens: its
        prompt's length; prompt_start: where the prompt starts among the row's token ids (after its
        soft-prompt placeholders). Tokens after the prompt are the generated ones.
        Settings that cannot be written (params broken after validation) do not raise: the row is
        written as greedy without logprobs, bans or penalties and its request fails alone at its
        next sampled step (SamplingBatch.errors), as a row whose sampling raises does.
        """
        try:
            self._write(row, params, generator, num_prompt_tokens, prompt_start)
            self.errors[row], self.has_error[row] = None, False
        except Exception as error:  # this request's settings alone are broken: it fails, the step goes on
            self._write(row, _HARMLESS, None, num_prompt_tokens, prompt_start)
            self.params[row] = None
            self.errors[row], self.has_error[row] = error, True

    def _write(self, row: int, params: SamplingParams, generator: torch.Generator | None, num_prompt_tokens: int,
               prompt_start: int) -> None:
        greedy = params.greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else params.temperature
        self.top_k[row] = params.top_k if 0 < params.top_k < self.vocab_size else self.vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.num_logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.presence_penalty[row] = params.presence_penalty
        self.frequency_penalty[row] = params.frequency_penalty
        self.repetition_penalty[row] = params.repetition_penalty
        self.has_penalties[row] = params.has_penalties
        self.min_tokens[row] = params.min_tokens
        self.prompt_start[row] = prompt_start
        self.prompt_end[row] = prompt_start + num_prompt_tokens
        self.has_generator[row] = generator is not None
        self.generators[row] = generator
        self.params[row] = params
        self._write_stop_ids(row, params)
        self.allowed.pop(row, None)
        self.bad_words.pop(row, None)
        self.bias.pop(row, None)
        if params.logit_bias:
            self.bias[row] = (np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias)),
                              np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))
        if params.allowed_token_ids is not None:
            self.allowed[row] = np.unique(np.asarray(params.allowed_token_ids, np.int64))
        if params.bad_words_token_ids:
            self.bad_words[row] = [list(word) for word in params.bad_words_token_ids]

    def remove_request(self, row: int) -> None:
        """Row `row` is free: drop its generator, params and error (the next add_request rewrites the rest)."""
        self.generators[row] = self.params[row] = self.errors[row] = None
        self.has_generator[row] = self.has_error[row] = False
        self.allowed.pop(row, None)
        self.bad_words.pop(row, None)
        self.bias.pop(row, None)

    def batch(self, rows: np.ndarray, token_ids: np.ndarray, num_tokens: np.ndarray,
              offsets: np.ndarray | None = None) -> SamplingBatch:
        """The settings of the sampled rows `rows` [S] (batch order), with their min_tokens bans and
        penalty histories read from the rows' token ids (token_ids [R, L], num_tokens [R]: InputBatch's).

        offsets [S] (speculative decoding): batch row i samples after the row's tokens and the next
        offsets[i] token ids written after them (its draft tokens), so its min_tokens count, bad-word
        prefix and penalty counts see those drafts as generated tokens; a row repeats in `rows` once
        per verified position. None: every offset is 0."""
        batch = self.settings(rows)
        ends = num_tokens[rows] if offsets is None else num_tokens[rows] + offsets  # [S] tokens before each one
        num_generated = ends - self.prompt_end[rows]  # [S] tokens generated before this one
        under = np.flatnonzero(num_generated < self.min_tokens[rows])  # [U] rows that may not stop yet
        if under.size:
            ids = self.stop_ids[rows[under]]  # [U, K]
            valid = ids >= 0  # [U, K]
            batch.ban_rows = np.broadcast_to(under[:, None], ids.shape)[valid]  # [N]
            batch.ban_ids = ids[valid]  # [N]
        if self.bad_words:
            self._add_bad_word_bans(batch, rows, token_ids, ends)
        for i in np.flatnonzero(batch.has_penalties).tolist():  # penalised rows only: views, no copy
            row = int(rows[i])
            start, end = int(self.prompt_start[row]), int(self.prompt_end[row])
            batch.histories[i] = (token_ids[row, start:end], token_ids[row, end:int(ends[i])])
        return batch

    def _add_bad_word_bans(self, batch: SamplingBatch, rows: np.ndarray, token_ids: np.ndarray,
                           ends: np.ndarray) -> None:
        """Append each bad-words row's bans (its generated tokens, up to ends[i], read from the row) to
        the batch's."""
        extra_rows, extra_ids = [], []
        for i, row in enumerate(rows.tolist()):
            words = self.bad_words.get(row)
            if words:
                banned = bad_word_bans(token_ids[row, int(self.prompt_end[row]):int(ends[i])], words)
                extra_rows += [i] * len(banned)
                extra_ids += banned
        if extra_rows:
            batch.ban_rows = np.concatenate([batch.ban_rows, np.asarray(extra_rows, np.int64)])
            batch.ban_ids = np.concatenate([batch.ban_ids, np.asarray(extra_ids, np.int64)])

    def settings(self, rows: np.ndarray) -> SamplingBatch:
        """The rows' settings alone (no bans, no histories)."""
        random_seeded = np.flatnonzero(self.has_generator[rows] & ~self.greedy[rows])  # [G]
        errors = {i: self.errors[rows[i]] for i in np.flatnonzero(self.has_error[rows]).tolist()}
        return SamplingBatch(
            self.temperature[rows], self.top_k[rows], self.top_p[rows], self.greedy[rows], self.num_logprobs[rows],
            self.presence_penalty[rows], self.frequency_penalty[rows], self.repetition_penalty[rows],
            self.has_penalties[rows], seeded=[(i, self.generators[rows[i]]) for i in random_seeded.tolist()],
            errors=errors, min_p=self.min_p[rows],
            allowed={i: self.allowed[row] for i, row in enumerate(rows.tolist()) if row in self.allowed}
            if self.allowed else {},
            bias={i: self.bias[row] for i, row in enumerate(rows.tolist()) if row in self.bias} if self.bias else {})

    def _write_stop_ids(self, row: int, params: SamplingParams) -> None:
        # the ids come from the stop rule the output processor applies; only min_tokens decides when
        ids = sorted(stop_tokens(params, 0, self._eos_token_ids).ids)
        if len(ids) > self.stop_ids.shape[1]:
            self.stop_ids = np.pad(self.stop_ids, ((0, 0), (0, len(ids) - self.stop_ids.shape[1])),
                                   constant_values=-1)
        self.stop_ids[row] = -1
        self.stop_ids[row, :len(ids)] = ids


_HARMLESS = SamplingParams(temperature=0.0, ignore_eos=True)  # what a row whose settings broke is written as


def explicit_batch(params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                   histories: Sequence[History | None] | None, banned: Sequence[Collection[int] | None] | None,
                   vocab_size: int) -> SamplingBatch:
    """A SamplingBatch from per-row lists: params[i], generators[i] (or None) of row i; histories[i]
    its (prompt, generated) token ids for penalties (None: not given); banned[i] the ids it may not
    sample (None: none). The settings are written as rows are (SamplingState.add_request)."""
    state = SamplingState(max_num_seqs=len(params), vocab_size=vocab_size)
    for row, (p, generator) in enumerate(zip(params, generators, strict=True)):
        state.add_request(row, p, generator)
    batch = state.settings(np.arange(len(params)))
    batch.histories = {i: h for i, h in enumerate(histories or ()) if h is not None}
    bans = [(i, t) for i, ids in enumerate(banned or ()) if ids for t in sorted(ids)]
    batch.ban_rows = np.array([i for i, _ in bans], np.int64)
    batch.ban_ids = np.array([t for _, t in bans], np.int64)
    return batch
