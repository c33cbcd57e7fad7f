"""Verification of draft tokens: each sequence keeps exactly the tokens (greedy) or the distribution
(sampled) it would get without speculation.

A speculating sequence with d drafts x_1..x_d is sampled at d + 1 positions of one forward pass:
position j's logits are the model's after the sequence's tokens and x_1..x_j, computed with the
sequence's own adapter. Every position goes through the Sampler's preparation with the sequence's
settings (temperature, top-k / top-p / min-p, allowed ids, bans), so p_j below is exactly the
distribution the one-token sampler would draw from at that position.

- greedy: x_{j+1} is accepted while it equals argmax p_j; the first mismatch yields the argmax
  instead, and when all d match the bonus token argmax p_d follows (the tokens of plain decoding);
- sampled (rejection sampling, Leviathan et al. 2023): the n-gram draft distribution is a point
  mass, so x_{j+1} is accepted with probability p_j(x_{j+1}); a rejection yields a sample of
  p_j with x_{j+1} removed (normalize(max(p_j - onehot(x_{j+1}), 0))), and after d acceptances a
  sample of p_d follows. Each yielded token is then distributed as p (the output distribution
  is unchanged); seeded requests draw every number from their own generator, so they reproduce.

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

logger = logging.getLogger(__name__)


class RejectionSampler:
    """Verifies each sampling sequence's draft tokens (see the module docstring) with the Sampler's
    preparation and generators."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch, drafts: Sequence[Sequence[int]]) -> SamplerOutput:
        """Tokens of each sequence from `logits` [N, V], N = sum(len(drafts[s]) + 1): sequence s's
        positions in order, then the next sequence's; `batch`: one row per position (the sequence's
        settings, SamplingBatch.select). Returns one row per sequence holding its 1 to d + 1 tokens.
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
        has_draft = draft >= 0  # [N]
        targets = penalized.max(dim=-1).indices  # [N] greedy tokens (first maximum, as the Sampler's)
        chosen, accepted = targets, has_draft & (draft == targets)  # [N] each
        if not settings.all_greedy:
            sampled_chosen, sampled_accepted = self._rejection_sample(penalized, settings, draft, has_draft)
            chosen = torch.where(settings.greedy, chosen, sampled_chosen)
            accepted = torch.where(settings.greedy, accepted, sampled_accepted)
        columns = [chosen[:, None].float(), finite[:, None].float()]  # Sampler.logprob_dicts' layout
        wanted = [k for k in settings.num_logprobs if k is not None]
        if wanted:
            logprobs = torch.log_softmax(raw, dim=-1)  # [N, V] raw model logprobs
            top_vals, top_ids = logprobs.topk(max(max(wanted), 1), dim=-1)  # [N, k]
            columns += [logprobs.gather(1, chosen[:, None]), top_vals, top_ids.float()]
        packed = torch.cat(columns + [accepted[:, None].float()], dim=1).cpu()  # the step's one transfer
        dicts = (self.sampler.logprob_dicts(packed[:, :-1], settings) if wanted else [None] * num_positions)
        return _walk(packed[:, 0].long().tolist(), packed[:, 1].bool().tolist(), packed[:, -1].bool().tolist(),
                     dicts, counts)

    def _rejection_sample(self, penalized: torch.Tensor, settings, draft: torch.Tensor,
                          has_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, accepted) [N] each for random rows: accept the draft with probability p(draft), else
        a sample of p without it; a position without a draft gets a sample of p."""
        probs = self.sampler.probs(penalized, settings)  # [N, V]
        uniform = torch.rand(probs.shape[0], generator=self.sampler.generator, device=probs.device)  # [N]
        for row, generator in settings.generators:
            uniform[row] = torch.rand(1, generator=generator, device=probs.device)
        index = draft.clamp(min=0)[:, None]  # [N, 1]
        accepted = has_draft & (uniform < probs.gather(1, index)[:, 0])  # [N]
        residual = probs.scatter(1, index, 0.0)  # [N, V] p without the draft (the race ignores the scale)
        recovered = self.sampler.race(torch.where(has_draft[:, None], residual, probs), settings.generators)
        return torch.where(accepted, draft, recovered), accepted


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
