"""Presence, frequency and repetition penalties (SamplingParams), applied to the rows that set them.

Per-row token counts are built on the device with one scatter_add into a [P, vocab] buffer (P =
rows with a penalty): how often each token occurs among a row's generated tokens, and whether it
occurs in its prompt. Rows without penalties are never touched (copied bit for bit).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

History = tuple[Sequence[int], Sequence[int]]  # (prompt token ids, generated token ids)


def apply_penalties(logits: torch.Tensor, rows: np.ndarray, presence: np.ndarray, frequency: np.ndarray,
                    repetition: np.ndarray, histories: Sequence[History]) -> torch.Tensor:
    """`logits` [S, V] with rows `rows` [P] penalised (presence[i], frequency[i], repetition[i] [P] float32
    and histories[i] for rows[i]): a new tensor.

    ValueError when a history holds a token id outside the vocabulary.
    """
    device = logits.device
    counts, in_prompt = token_counts(rows.tolist(), histories, logits.shape[-1], device)  # [P, V] each

    def column(values: np.ndarray) -> torch.Tensor:  # [P, 1]
        return torch.from_numpy(np.asarray(values, np.float32)).to(device)[:, None]

    index = torch.from_numpy(np.asarray(rows, np.int64)).to(device)  # [P]
    picked = logits.index_select(0, index)  # [P, V]
    seen = in_prompt | (counts > 0)  # [P, V]: repetition covers prompt and generated tokens
    repetition = column(repetition)  # [P, 1]
    picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
    picked = picked - column(frequency) * counts  # [P, V]
    picked = picked - column(presence) * (counts > 0)  # [P, V]
    return logits.index_copy(0, index, picked)  # [S, V]; the other rows are copied bit for bit


def token_counts(rows: Sequence[int], histories: Sequence[History], vocab: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per history (of batch row rows[i], named in errors): how often each token occurs among its
    generated tokens, and whether it occurs in its prompt ([P, V] float32 and bool); one host->device copy each."""
    tokens, owners, generated = [], [], []  # per token: its id, its row among the histories, 1.0 if generated
    for position, (row, history) in enumerate(zip(rows, histories)):
        for ids, is_generated in zip(history, (0.0, 1.0)):
            ids = np.asarray(ids, np.int64)  # lists (explicit batches) or views of a row's token ids
            if len(ids) and not (0 <= ids.min() and ids.max() < vocab):
                raise ValueError(f"row {row}: a token id of its history lies outside the vocabulary [0, {vocab})")
            tokens.append(torch.from_numpy(ids))
            owners.append(torch.full((len(ids),), position, dtype=torch.int64))
            generated.append(torch.full((len(ids),), is_generated))
    flat = (torch.cat(owners) * vocab + torch.cat(tokens)).to(device)  # [N] index into [P * V]
    is_generated = torch.cat(generated).to(device)  # [N] float32
    num_rows = len(histories)
    counts = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    counts.scatter_add_(0, flat, is_generated)
    in_prompt = torch.zeros(num_rows * vocab, dtype=torch.float32, device=device)
    in_prompt.scatter_add_(0, flat, 1.0 - is_generated)
    return counts.view(num_rows, vocab), in_prompt.view(num_rows, vocab) > 0
