"""Masks that take ids out of a row's choice (structured-output bitmasks, allowed_token_ids, bad_words),
and the logit bias that shifts ids' odds (SamplingParams.logit_bias).

The masks set logits to -inf after the penalties and before temperature / top-k / top-p (greedy
rows included); the bias is added before the penalties, as in vLLM. Both work on a copy: the logprobs
stay the raw model's, as in vLLM. Rows without a mask or a bias are never touched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

_BITS = torch.arange(32, dtype=torch.int32)  # [32] bit positions of one packed int32 word


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[C, W] int32 packed bitmask -> [C, vocab_size] bool (bit t % 32 of word t // 32: id t allowed,
    xgrammar's layout)."""
    bits = _BITS.to(bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1  # [C, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [C, V]; ids past W * 32 never exist


def apply_grammar_bitmask(logits: torch.Tensor, rows: np.ndarray, bitmask: torch.Tensor) -> None:
    """In place: rows `rows` [C] of `logits` [S, V] keep only the ids their bitmask [C, W] allows.

    Ids past the bitmask's width (a model vocabulary larger than 32 * W) are banned too."""
    vocab = logits.shape[-1]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)  # [C, V]
    width = min(vocab, bitmask.shape[1] * 32)
    allowed[:, :width] = unpack_bitmask(bitmask.to(logits.device), width)
    index = torch.from_numpy(np.asarray(rows, np.int64)).to(logits.device)  # [C]
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_allowed_token_ids(logits: torch.Tensor, allowed: Mapping[int, np.ndarray]) -> None:
    """In place: each row r of `allowed` keeps only the ids allowed[r] (SamplingParams.allowed_token_ids)."""
    for row, ids in allowed.items():
        keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)  # [V]
        keep[torch.from_numpy(ids).to(logits.device)] = True
        logits[row].masked_fill_(~keep, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, bias: Mapping[int, tuple[np.ndarray, np.ndarray]]) -> torch.Tensor:
    """`logits` [S, V] with bias[r] = (ids [B] int64, values [B] float32) added to row r's logits at those ids:
    a new tensor (one scatter for every biased row; each row's ids are distinct, as a dict's keys are)."""
    rows = np.concatenate([np.full(len(ids), row, np.int64) for row, (ids, _) in bias.items()])  # [N]
    ids = np.concatenate([ids for ids, _ in bias.values()])  # [N]
    values = np.concatenate([values for _, values in bias.values()])  # [N]
    device = logits.device
    index = (torch.from_numpy(rows).to(device), torch.from_numpy(ids).to(device))
    return logits.index_put(index, torch.from_numpy(values).to(device), accumulate=True)  # [S, V]


def bad_word_bans(generated: Sequence[int], bad_words_token_ids: Sequence[Sequence[int]]) -> list[int]:
    """The ids a row may not sample next (vLLM's bad_words): the last token of every bad-word sequence
    whose other tokens end `generated` (a one-token word is always banned)."""
    banned = []
    for word in bad_words_token_ids:
        prefix = len(word) - 1
        if prefix == 0 or (len(generated) >= prefix and list(generated[len(generated) - prefix:]) == list(word[:-1])):
            banned.append(int(word[-1]))
    return banned
