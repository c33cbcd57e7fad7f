"""Verification of draft tokens: each sequence keeps exactly the tokens (greedy) or the distribution
(sampled) it would get without speculation.

A speculating sequence with d drafts x_1..x_d is sampled at d + 1 positions of one forward pass:
position j's logits are the model's after the sequence's tokens and x_1..x_j, computed with the
sequence's own adapter. Every position goes through the Sampler's preparation with the sequence's
settings as they stand after x_1..x_j (temperature, top-k / top-p / min-p and allowed ids; penalty
counts, min_tokens and bad-word bans and the grammar mask that count the drafts before it as
generated: lora_runner.sample.sampling_state, lora_runner.spec_decode.grammar_masks), so p_j below is
exactly the distribution the one-token sampler would draw from at that position had x_1..x_j been
sampled. Tokens after the first rejected draft are never kept, so a position whose settings assumed
a draft that was not accepted is never read.

- greedy: x_{j+1} is accepted while it equals argmax p_j; the first mismatch yields the argmax
  instead, and when all d match the bonus token argmax p_d follows (the tokens of plain decoding);
- sampled: rejection sampling (Leviathan et al. 2023) with the n-gram's point-mass draft accepts
  x_{j+1} with probability p_j(x_{j+1}) and, on rejection, yields a sample of
  normalize(max(p_j - onehot(x_{j+1}), 0)). For a point mass that is the same as sampling
  t ~ p_j and accepting while t == x_{j+1} (P(accept) = p_j(x), and a rejected t is p_j given
  t != x), which is how it is done here: each position samples p_j by the Sampler's exponential
  race, a seeded request drawing position j's numbers from its own generator, and after the step the
  generator is rewound past the positions whose tokens were not kept. A seeded request's k-th token
  thus uses the k-th draws of its generator with or without speculation, whatever else is batched:
  it gets the same tokens as without speculation (up to float roundoff deciding a near-tie).

Sequences without drafts in the same step have one position: argmax, or a sample of p_0. Logprobs
are the raw model log-probabilities at each yielded token's position, as the Sampler's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from lora_runner.sample.sampler import NonFiniteLogitsError, Sampler, SamplerOutput
from lora_runner.sample.sampling_state import SamplingBatch
from punica_kernels import invariant

logger = logging.getLogger(__name__)


class RejectionSampler:
    """Verifies each sampling sequence's draft tokens (see the module docstring) with the Sampler's
    preparation and generators."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]]) -> SamplerOutput:
        """Tokens of each sequence from `logits` [N, V], N = sum(len(drafts[s]) + 1): sequence s's
        positions in order, then the next sequence's; `batch`: one row per position (the sequence's
        settings at that position: InputBatch.sampling_batch; SamplingBatch.select repeats a row). Returns one row per sequence holding its 1 to d + 1 tokens.
        A sequence whose settings are broken or whose logits at a yielded position are not finite
        fails alone; should verifying them together raise, each is verified alone."""
        counts = np.fromiter((len(d) + 1 for d in drafts), np.int64, len(drafts))  # [S]
        assert int(counts.sum()) == logits.shape[0] == batch.num_rows, "one logits row and setting per position"
        states = self.sampler.generator_states(batch)
        try:
            result = self._verify(logits.float(), batch, drafts, counts)
        except Exception as error:  # one sequence broke the batch: find it
            logger.warning("verifying %d sequences together failed (%r): one at a time", len(drafts), error)
            self.sampler.restore_generators(states)
            result = self._verify_one_at_a_time(logits.float(), batch, drafts, counts)
        seq_of = np.repeat(np.arange(len(drafts)), counts)  # [N] sequence of each position
        for position, error in batch.errors.items():  # settings that could not be written
            result.fail(int(seq_of[position]), error)
        return result

    def _verify_one_at_a_time(self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]],
                              counts: np.ndarray) -> SamplerOutput:
        result = SamplerOutput([], [], [])
        first = np.cumsum(counts) - counts
        for seq, (start, count) in enumerate(zip(first.tolist(), counts.tolist())):
            positions = np.arange(start, start + count)
            try:
                one = self._verify(logits[start:start + count], batch.select(positions), [drafts[seq]],
                                   counts[seq:seq + 1])
            except Exception as error:  # this sequence alone fails: its request gets the error
                logger.warning("verifying sequence %d failed: %r", seq, error)
                one = SamplerOutput([[]], [[]], [error])
            result.extend(one)
        return result

    def _verify(self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]],
                counts: np.ndarray) -> SamplerOutput:
        raw, penalized, finite, settings = self.sampler.prepare(logits, batch)
        num_positions = raw.shape[0]
        draft_ids = np.full(num_positions, -1, np.int64)  # [N] the draft each position verifies, -1: bonus
        first = np.cumsum(counts) - counts  # [S]
        for start, tokens in zip(first.tolist(), drafts):
            draft_ids[start:start + len(tokens)] = tokens
        draft = torch.from_numpy(draft_ids).to(raw.device)  # [N]
        chosen = invariant.argmax(penalized)  # [N] greedy tokens (first maximum, as the Sampler's)
        rewind: dict[int, tuple[torch.Generator, torch.Tensor]] = {}
        if not settings.all_greedy:
            chosen = torch.where(settings.greedy, chosen, self._sample(penalized, settings, rewind))
        accepted = (draft >= 0) & (chosen == draft)  # [N]
        columns = [chosen[:, None].float(), finite[:, None].float()]  # Sampler.logprob_dicts' layout
        wanted = [k for k in settings.num_logprobs if k is not None]
        if wanted:
            # the batch-invariant mode's per-row kernels on CUDA, as the Sampler's (punica_kernels.invariant)
            logprobs = invariant.softmax(raw, log=True)  # [N, V] raw model logprobs
            top_vals, top_ids = invariant.topk(logprobs, max(max(wanted), 1))  # [N, k]
            columns += [logprobs.gather(1, chosen[:, None]), top_vals, top_ids.float()]
        packed = torch.cat(columns + [accepted[:, None].float()], dim=1).cpu()  # the step's one transfer
        dicts = (self.sampler.logprob_dicts(packed[:, :-1], settings) if wanted else [None] * num_positions)
        result = _walk(packed[:, 0].long().tolist(), packed[:, 1].bool().tolist(), packed[:, -1].bool().tolist(),
                       dicts, counts)
        for start, count, tokens in zip(first.tolist(), counts.tolist(), result.sampled_token_ids):
            if tokens and len(tokens) < count and start + len(tokens) in rewind:  # its unused draws come again
                generator, state = rewind[start + len(tokens)]
                generator.set_state(state)
        return result

    def _sample(self, penalized: torch.Tensor, settings, rewind: dict) -> torch.Tensor:
        """A sample [N] of each position's distribution p by the Sampler's exponential race; a seeded
        position draws from its generator in position order, and `rewind` gets each one's generator
        state before its draw (position -> (generator, state))."""
        probs = self.sampler.probs(penalized, settings)  # [N, V]
        q = torch.empty_like(probs).exponential_(generator=self.sampler.generator)  # [N, V]
        for position, generator in settings.generators:
            rewind[position] = generator, generator.get_state()
            q[position].exponential_(generator=generator)
        return invariant.argmax(probs / q.clamp_min_(1e-20))  # [N] as Sampler.race


def _walk(chosen: list[int], finite: list[bool], accepted: list[bool], dicts: list,
          counts: np.ndarray) -> SamplerOutput:
    """Each sequence's tokens: its positions' tokens up to the first one not accepted (a rejected
    draft's replacement, or the bonus token at its last position)."""
    tokens, logprobs, errors = [], [], []
    starts = np.cumsum(counts) - counts  # [S]
    for start, count in zip(starts.tolist(), counts.tolist()):
        row_tokens, row_logprobs, error = [], [], None
        for position in range(start, start + count):
            if not finite[position]:
                error = NonFiniteLogitsError("the model's logits for this request hold NaN or inf "
                                             "(an adapter's weights may be too large)")
                break
            row_tokens.append(chosen[position])
            row_logprobs.append(dicts[position])
            if not accepted[position]:
                break
        tokens.append([] if error else row_tokens)
        logprobs.append([] if error else row_logprobs)
        errors.append(error)
    return SamplerOutput(tokens, logprobs, errors)
