"""Token sampling for a batch of requests with their own settings, plus top-k logprobs.

Greedy rows take the argmax. Other rows divide the logits by their temperature, mask to top-k /
top-p, and sample by an exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i
with probability probs[i]. A seeded request draws its q from its own torch.Generator, so its
tokens do not depend on what else is batched with it. All rows are computed together and the
results reach the host in one transfer per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lora_runner.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one step (S rows), as device tensors."""

    temperatures: torch.Tensor  # [S] float32, 1.0 for greedy rows (unused there)
    top_k: torch.Tensor  # [S] int64, vocab size when off
    top_p: torch.Tensor  # [S] float32
    greedy: torch.Tensor  # [S] bool
    generators: list[tuple[int, torch.Generator]]  # (row, generator) of seeded random rows
    num_logprobs: list[int | None]  # per row: k, or None for no logprobs
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool


@dataclass
class SamplerOutput:
    """Sampled token per row and, where asked, its logprobs dict."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Samples one token per row of a [S, vocab] float32 logits tensor."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # draws for rows without their own seed
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def make_batch(self, params: Sequence[SamplingParams],
                   generators: Sequence[torch.Generator | None]) -> SamplingBatch:
        """Collect the rows' settings; generators[i] is row i's own generator or None."""
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size for p in params]
        top_p = [p.top_p for p in params]
        random_rows = [i for i, g in enumerate(greedy) if not g]
        return SamplingBatch(
            temperatures=torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                      dtype=torch.float32, device=self.device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=self.device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=self.device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=self.device),
            generators=[(i, generators[i]) for i in random_rows if generators[i] is not None],
            num_logprobs=[p.logprobs for p in params],
            all_greedy=not random_rows,
            use_top_k=any(top_k[i] < self.vocab_size for i in random_rows),
            use_top_p=any(top_p[i] < 1.0 for i in random_rows))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from `logits` [S, vocab]; returns host lists (one device->host sync)."""
        logits = logits.float()  # [S, V]
        tokens = logits.argmax(dim=-1)  # [S]
        if not batch.all_greedy:
            tokens = torch.where(batch.greedy, tokens, self._sample(logits, batch))  # [S]
        wanted = [k for k in batch.num_logprobs if k is not None]
        if not wanted:
            return SamplerOutput(tokens.tolist(), [None] * len(batch.num_logprobs))
        logprobs = torch.log_softmax(logits, dim=-1)  # [S, V] raw model logprobs
        chosen = logprobs.gather(1, tokens[:, None])  # [S, 1]
        top_vals, top_ids = logprobs.topk(max(max(wanted), 1), dim=-1)  # [S, k]
        packed = torch.cat([tokens[:, None].to(logprobs.dtype), chosen, top_vals,
                            top_ids.to(logprobs.dtype)], dim=1).cpu()  # [S, 2 + 2k]
        return SamplerOutput(packed[:, 0].long().tolist(), self._logprob_dicts(packed, batch))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        scaled = logits / batch.temperatures[:, None]  # [S, V]
        if batch.use_top_k or batch.use_top_p:
            scaled = self._mask_top_k_top_p(scaled, batch)
        probs = torch.softmax(scaled, dim=-1)  # [S, V]
        q = torch.empty_like(probs).exponential_(generator=self.generator)  # [S, V]
        for row, generator in batch.generators:
            q[row].exponential_(generator=generator)
        return (probs / q.clamp_min_(1e-20)).argmax(dim=-1)  # [S]

    @staticmethod
    def _mask_top_k_top_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [S, V] each
        if batch.use_top_k:
            ranks = torch.arange(scaled.shape[-1], device=scaled.device)  # [V]
            sorted_logits.masked_fill_(ranks[None, :] >= batch.top_k[:, None], float("-inf"))
        if batch.use_top_p:
            probs = sorted_logits.softmax(dim=-1)  # [S, V]
            mass_before = probs.cumsum(dim=-1) - probs  # [S, V]; the top token always stays
            sorted_logits.masked_fill_(mass_before > batch.top_p[:, None], float("-inf"))
        return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)  # [S, V]

    @staticmethod
    def _logprob_dicts(packed: torch.Tensor, batch: SamplingBatch) -> list[dict[int, float] | None]:
        num_top = (packed.shape[1] - 2) // 2
        rows = packed.tolist()
        result: list[dict[int, float] | None] = []
        for row, k in zip(rows, batch.num_logprobs):
            if k is None:
                result.append(None)
                continue
            entry = {int(tid): lp for tid, lp in zip(row[2 + num_top:2 + num_top + k], row[2:2 + k])}
            entry[int(row[0])] = row[1]
            result.append(entry)
        return result
