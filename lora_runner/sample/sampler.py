"""Token sampling for a batch of requests with their own settings, plus top-k logprobs.

Greedy rows take the argmax. Other rows divide the logits by their temperature, mask to top-k /
top-p, and sample by an exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i
with probability probs[i]. A seeded request draws its q from its own torch.Generator, so its
tokens do not depend on what else is batched with it. All rows are computed together and the
results reach the host in one transfer per step.

The logit bias (SamplingParams.logit_bias, lora_runner.sample.token_masks) is added first, then
penalties (SamplingParams.presence_penalty, frequency_penalty, repetition_penalty;
lora_runner.sample.penalties) change the logits of the rows that set them before
greedy/temperature/top-k/top-p (vLLM's order); a step without biased or penalised rows skips all of
it. The logprobs returned stay the raw model log-probabilities (before bias and penalties, like the
other settings).
Masks come next (lora_runner.sample.token_masks): banned ids (min_tokens, bad_words), allowed_token_ids
and the structured-output bitmask of the step's constrained rows; a step without any touches nothing.

In the batch-invariant mode (punica_kernels.invariant) on CUDA every row op whose torch kernel follows
the batch runs per row: the softmaxes, the top-p mass (a scan in fixed chunks), the argmaxes and the
top logprobs (exact selections, the lowest token id on ties) and the top-k / top-p sort (stable). A
seeded row's draws come from its own generator, one draw per token of the vocabulary whatever the
batch, so its tokens repeat bit for bit; an unseeded row draws from the sampler's shared generator,
whose stream follows the batch. Off CUDA the torch ops already run each row alone: nothing changes.

Faults stay in their row: a row with NaN/inf logits, whose sampling raises, or whose settings could not
be written (SamplingBatch.errors), comes back with an error in SamplerOutput.errors (its request
fails, and its row holds no token) while every other row gets its usual token.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from lora_runner.sample.penalties import apply_penalties
from lora_runner.sample.prompt_logprobs import PromptLogprobsChunk
from lora_runner.sample.sampling_state import History, SamplingBatch, explicit_batch
from lora_runner.sample.token_masks import apply_allowed_token_ids, apply_grammar_bitmask, apply_logit_bias
from lora_runner.sampling_params import SamplingParams
from punica_kernels import invariant

logger = logging.getLogger(__name__)


class NonFiniteLogitsError(FloatingPointError):
    """A row's logits hold NaN or inf (for instance an adapter whose huge weights overflow the
    activations): its request cannot be sampled and fails, the other rows are unaffected."""


@dataclass
class _RowSettings:
    """A SamplingBatch's sampling settings as device tensors."""

    # the four tensors are None when every row is greedy
    temperatures: torch.Tensor | None  # [S] float32, 1.0 for greedy rows (unused there)
    top_k: torch.Tensor | None  # [S] int64, vocab size when off
    top_p: torch.Tensor | None  # [S] float32
    greedy: torch.Tensor | None  # [S] bool
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded random rows
    num_logprobs: list[int | None]  # [S] k, or None for no logprobs
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    min_p: torch.Tensor | None = None  # [S] float32, set when some random row uses min_p


@dataclass
class PreparedLogits:
    """Sampler.prepare's result: the rows' logits ready to pick tokens from."""

    raw: torch.Tensor  # [S, V] float32 model logits (non-finite rows zeroed): the logprobs read them
    penalized: torch.Tensor  # [S, V] after logit bias, penalties, bans, allowed ids and the grammar mask
    finite: torch.Tensor  # [S] bool: the row's logits were finite (else it fails)
    settings: _RowSettings

    def __iter__(self):
        return iter((self.raw, self.penalized, self.finite, self.settings))


@dataclass
class SamplerOutput:
    """The step's sampled tokens: per row a list of token ids in order and a parallel list of their
    logprob dicts (vLLM's sampled_token_ids), and per row the exception that kept it from being
    sampled (None when it was; a failed row has no tokens).

    The Sampler gives every row one token. A step that yields several tokens per row (speculative
    decoding's verified tokens) uses the same lists: InputBatch.commit, Scheduler.postprocess and
    OutputProcessor.append take each row's tokens in order, and a request that finishes on one of
    them drops the rest.
    """

    sampled_token_ids: list[list[int]]  # [S][k_s] tokens of row s, in order; [] for a failed row
    sampled_logprobs: list[list[dict[int, float] | None]]  # [S][k_s] each token's top-k dict, None where not asked
    errors: list[BaseException | None] = field(default_factory=list)  # [] on construction = none failed
    # request id -> the prompt logprobs its chunk computed this step (lora_runner.sample.prompt_logprobs)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.errors:
            self.errors = [None] * len(self.sampled_token_ids)
        assert len(self.sampled_logprobs) == len(self.sampled_token_ids) == len(self.errors), \
            "one token list, logprob list and error per row"

    @classmethod
    def one_per_row(cls, token_ids: Sequence[int], logprobs: Sequence[dict[int, float] | None],
                    errors: Sequence[BaseException | None] = ()) -> SamplerOutput:
        """One token per row (the Sampler's case); a row with an error gets no token."""
        errors = list(errors) or [None] * len(token_ids)
        return cls([[] if error is not None else [token] for token, error in zip(token_ids, errors)],
                   [[] if error is not None else [entry] for entry, error in zip(logprobs, errors)], errors)

    def fail(self, row: int, error: BaseException) -> None:
        """Row `row` failed with `error`: its tokens and logprobs are gone."""
        self.sampled_token_ids[row], self.sampled_logprobs[row], self.errors[row] = [], [], error

    def extend(self, other: SamplerOutput) -> None:
        """Append `other`'s rows after this one's."""
        self.sampled_token_ids += other.sampled_token_ids
        self.sampled_logprobs += other.sampled_logprobs
        self.errors += other.errors

    # the single-position view: callers that sample one position per row (explicit chunks, tests)
    @property
    def token_ids(self) -> list[int]:
        """The one token of each row, -1 for a failed row; a step with several tokens in a row raises."""
        return [self._single(row, tokens, -1) for row, tokens in enumerate(self.sampled_token_ids)]

    @property
    def logprobs(self) -> list[dict[int, float] | None]:
        """The logprob dict of each row's one token, None for a failed row or one that asked for none."""
        return [self._single(row, entries, None) for row, entries in enumerate(self.sampled_logprobs)]

    @staticmethod
    def _single(row: int, values: list, empty):
        assert len(values) <= 1, f"row {row} holds {len(values)} tokens: read sampled_token_ids / sampled_logprobs"
        return values[0] if values else empty


def _finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[S] bool: row s of logits [S, V] holds no NaN or inf.

    On the host, a row whose sum is finite has only finite entries (NaN and inf make any sum NaN or
    inf), and a sum is ~20x cheaper than isfinite over every entry; only rows whose sum is not finite
    (a non-finite entry, or finite entries overflowing the sum) are checked entry by entry. On a device
    reading the sums would sync: the entry check alone.
    """
    if not logits.is_cpu:
        return torch.isfinite(logits).all(dim=-1)
    finite = torch.isfinite(logits.sum(dim=-1))  # [S]
    if not bool(finite.all()):
        finite = torch.isfinite(logits).all(dim=-1)
    return finite


class Sampler:
    """Samples one token per row of a [S, vocab] float32 logits tensor (a SamplerOutput whose rows
    each hold one token, none for a failed row).

    A row whose logits are not finite fails alone (NonFiniteLogitsError); the other rows are sampled
    as if it were not there. Should sampling the rows together raise, they are sampled again one at
    a time (generators rewound first, so seeded rows draw the same numbers) and only the rows that
    raise alone fail.
    """

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # draws for rows without their own seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_batch(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None],
                   histories: Sequence[History | None] | None = None,
                   banned: Sequence[Collection[int] | None] | None = None) -> SamplingBatch:
        """A batch from explicit per-row lists (memory profile, tests; the engine's rows come from a
        SamplingState): generators[i] is row i's own generator or None; histories[i] is row i's
        (prompt token ids, generated token ids), needed by rows with penalties; banned[i]: token ids
        row i may not sample (its EOS and stop ids while it is under min_tokens), or None."""
        return explicit_batch(params, generators, histories, banned, self.vocab_size)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from `logits` [S, vocab]; returns host lists (one device->host sync)."""
        logits = logits.float()  # [S, V]
        states = self.generator_states(batch)
        try:
            result = self._sample_together(logits, batch)
        except Exception as error:  # one row broke the batch: find it below
            logger.warning("sampling %d rows together failed (%r): sampling them one at a time",
                           batch.num_rows, error)
            self.restore_generators(states)
            result = self._sample_one_at_a_time(logits, batch)
        for row, error in batch.errors.items():  # settings that could not be written: sampled harmlessly, failed
            result.fail(row, error)
        return result

    def prepare(self, logits: torch.Tensor, batch: SamplingBatch) -> PreparedLogits:
        """The part of sampling before a token is picked (shared with the rejection sampler,
        lora_runner.spec_decode): non-finite rows zeroed and flagged, logit bias, penalties, bans and masks applied."""
        finite = _finite_rows(logits)  # [S]
        if not (logits.is_cpu and bool(finite.all())):  # on the host the check is free: skip the copy
            logits = torch.where(finite[:, None], logits, 0.0)  # [S, V]; a broken row's numbers reach no other row
        settings = self._settings(batch)
        biased = apply_logit_bias(logits, batch.bias) if batch.bias else logits  # [S, V]
        penalized = self._apply_penalties(biased, batch)  # [S, V]; `logits` stay raw for the logprobs
        if penalized is not logits:  # a tiny repetition_penalty can overflow a row: it fails alone
            finite &= torch.isfinite(penalized).all(dim=-1)
            penalized = torch.where(finite[:, None], penalized, 0.0)
        penalized = self._apply_bans(penalized, logits, batch)
        return PreparedLogits(logits, penalized, finite, settings)

    def _sample_together(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits, penalized, finite, settings = self.prepare(logits, batch)
        # max's indices are argmax's (the first maximum, documented for both), in half argmax's CPU time;
        # invariant.argmax: max's, or in the batch-invariant mode on CUDA a per-row kernel (lowest id on ties)
        tokens = invariant.argmax(penalized)  # [S]
        if not settings.all_greedy:
            tokens = torch.where(settings.greedy, tokens, self._sample(penalized, settings))  # [S]
        columns = [tokens[:, None].float(), finite[:, None].float()]  # [S, 1] each
        wanted = [k for k in settings.num_logprobs if k is not None]
        if wanted:
            # invariant.softmax: torch's in the default mode; per row in the batch-invariant mode on CUDA
            logprobs = invariant.softmax(logits, log=True)  # [S, V] raw model logprobs
            top_vals, top_ids = invariant.topk(logprobs, max(max(wanted), 1))  # [S, k]; the mode: lowest id on ties
            columns += [logprobs.gather(1, tokens[:, None]), top_vals, top_ids.float()]
        packed = torch.cat(columns, dim=1).cpu()  # [S, 2] or [S, 3 + 2k]: the step's one transfer
        token_ids = packed[:, 0].long().tolist()
        dicts = self.logprob_dicts(packed, settings) if wanted else [None] * len(token_ids)
        errors = [None if ok else NonFiniteLogitsError("the model's logits for this request hold NaN or inf "
                                                       "(an adapter's weights may be too large)")
                  for ok in packed[:, 1].bool().tolist()]
        return SamplerOutput.one_per_row(token_ids, dicts, errors)

    def _sample_one_at_a_time(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        result = SamplerOutput([], [], [])
        for row in range(batch.num_rows):
            try:
                one = self._sample_together(logits[row:row + 1], batch.row(row))
            except Exception as error:  # this row alone fails: its request gets the error
                logger.warning("sampling row %d failed: %r", row, error)
                one = SamplerOutput([[]], [[]], [error])
            result.extend(one)
        return result

    def _apply_bans(self, penalized: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`penalized` [S, V] with each row's banned token ids at -inf, and only its allowed ids and
        those its grammar bitmask allows left (a copy when `penalized` is the raw logits, which the
        logprobs read); itself when no row bans or constrains anything."""
        if not batch.ban_rows.size and not batch.allowed and batch.grammar_bitmask is None:
            return penalized
        if penalized is raw:
            penalized = penalized.clone()
        if batch.ban_rows.size:
            rows = torch.from_numpy(batch.ban_rows).to(penalized.device)  # [N]
            cols = torch.from_numpy(batch.ban_ids).to(penalized.device)  # [N]
            penalized[rows, cols] = float("-inf")
        if batch.allowed:
            apply_allowed_token_ids(penalized, batch.allowed)
        if batch.grammar_bitmask is not None:
            apply_grammar_bitmask(penalized, batch.grammar_rows, batch.grammar_bitmask)
        return penalized

    def _apply_penalties(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """`logits` [S, V] with the penalised rows' penalties applied (lora_runner.sample.penalties)."""
        rows = np.flatnonzero(batch.has_penalties)  # [P]
        if not rows.size:
            return logits
        return apply_penalties(logits, rows, batch.presence_penalty[rows], batch.frequency_penalty[rows],
                               batch.repetition_penalty[rows], [batch.history(i) for i in rows.tolist()])

    def generator_states(self, batch: SamplingBatch) -> list[tuple[torch.Generator, torch.Tensor]]:
        """The states of the generators sampling `batch` draws from (to rewind them before a retry)."""
        generators = [self.generator, *(g for _, g in batch.seeded)]
        return [(g, g.get_state()) for g in generators]

    @staticmethod
    def restore_generators(states: list[tuple[torch.Generator, torch.Tensor]]) -> None:
        """Rewind generators to the states generator_states took."""
        for generator, state in states:
            generator.set_state(state)

    def _settings(self, batch: SamplingBatch) -> _RowSettings:
        num_logprobs = [None if k < 0 else k for k in batch.num_logprobs.tolist()]
        if batch.greedy.all():  # argmax alone: no per-row tensor is read
            return _RowSettings(None, None, None, None, [], num_logprobs, all_greedy=True,
                                use_top_k=False, use_top_p=False)
        random_rows = ~batch.greedy  # [S]
        use_min_p = batch.min_p is not None and bool((batch.min_p[random_rows] > 0).any())
        return _RowSettings(
            temperatures=torch.from_numpy(batch.temperature).to(self.device),
            top_k=torch.from_numpy(batch.top_k).to(self.device),
            top_p=torch.from_numpy(batch.top_p).to(self.device),
            greedy=torch.from_numpy(batch.greedy).to(self.device),
            generators=batch.seeded,
            num_logprobs=num_logprobs,
            all_greedy=False,
            use_top_k=bool((batch.top_k[random_rows] < self.vocab_size).any()),
            use_top_p=bool((batch.top_p[random_rows] < 1.0).any()),
            min_p=torch.from_numpy(batch.min_p).to(self.device) if use_min_p else None)

    def _sample(self, logits: torch.Tensor, batch: _RowSettings) -> torch.Tensor:
        return self.race(self.probs(logits, batch), batch.generators)  # [S]

    def probs(self, logits: torch.Tensor, batch: _RowSettings) -> torch.Tensor:
        """The distribution [S, V] each random row samples from: its penalised, masked `logits` [S, V]
        after temperature, min-p, top-k and top-p (the rejection sampler accepts drafts against it)."""
        scaled = logits / batch.temperatures[:, None]  # [S, V]
        if batch.min_p is not None:  # as vLLM: after temperature, before top-k / top-p
            probs = invariant.softmax(scaled)  # [S, V]
            too_unlikely = probs < batch.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [S, V]
            scaled = scaled.masked_fill(too_unlikely, float("-inf"))
        if batch.use_top_k or batch.use_top_p:
            scaled = self._mask_top_k_top_p(scaled, batch)
        return invariant.softmax(scaled)  # [S, V]

    def race(self, probs: torch.Tensor, generators: Sequence[tuple[int, torch.Generator]]) -> torch.Tensor:
        """One token per row of `probs` [S, V] (any non-negative weights: the race ignores their scale)
        by the exponential race; rows in `generators` (row, generator) draw from their own generator."""
        q = torch.empty_like(probs).exponential_(generator=self.generator)  # [S, V]
        for row, generator in generators:
            q[row].exponential_(generator=generator)
        return invariant.argmax(probs / q.clamp_min_(1e-20))  # [S]: the argmax (see _sample_together)

    @staticmethod
    def _mask_top_k_top_p(scaled: torch.Tensor, batch: _RowSettings) -> torch.Tensor:
        sorted_logits, order = invariant.sort_descending(scaled)  # [S, V] each; stable in the mode on CUDA
        if batch.use_top_k:
            ranks = torch.arange(scaled.shape[-1], device=scaled.device)  # [V]
            sorted_logits.masked_fill_(ranks[None, :] >= batch.top_k[:, None], float("-inf"))
        if batch.use_top_p:
            probs = invariant.softmax(sorted_logits)  # [S, V]
            # invariant.cumsum: torch's, or in the mode on CUDA a per-row scan in fixed chunks
            mass_before = invariant.cumsum(probs) - probs  # [S, V]; the top token always stays
            sorted_logits.masked_fill_(mass_before > batch.top_p[:, None], float("-inf"))
        return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)  # [S, V]

    @staticmethod
    def logprob_dicts(packed: torch.Tensor, settings: _RowSettings) -> list[dict[int, float] | None]:
        """packed rows: token, finite flag, chosen logprob, k top logprobs, k top ids."""
        num_top = (packed.shape[1] - 3) // 2
        result: list[dict[int, float] | None] = []
        for row, k in zip(packed.tolist(), settings.num_logprobs):
            if k is None:
                result.append(None)
                continue
            entry = {int(tid): lp for tid, lp in zip(row[3 + num_top:3 + num_top + k], row[3:3 + k])}
            entry[int(row[0])] = row[2]
            result.append(entry)
        return result
