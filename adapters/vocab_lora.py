"""PEFT LoRA on ``embed_tokens`` and ``lm_head``: the per-model (not per-layer) factors of an adapter.

PEFT's embedding LoRA (``peft.tuners.lora.layer.Embedding``) stores ``lora_embedding_A`` [r, vocab]
and ``lora_embedding_B`` [hidden, r]; token t's delta is ``scaling * B @ A[:, t]``. ``lm_head`` is an
``nn.Linear``: ``lora_A`` [r, hidden], ``lora_B`` [vocab, r], as any projection. Both land in
:attr:`adapters.lora.LoRAWeights.vocab` as a ``LoRAPair(a, b)`` with the scaling folded into b, so the
delta is ``x @ a.T @ b.T`` in both cases (x the one-hot of t for the embedding).

PEFT's ``save_pretrained`` also writes a full copy of each of these base layers
(``<module>.base_layer.weight``, its ``save_embedding_layers="auto"``). A copy of the base model's
shape is ignored: the served model's weights are used. Any other shape means the adapter was trained
on a resized vocabulary: refused, as are ``modules_to_save`` (whole replacement modules),
``trainable_token_indices`` and ``ensure_weight_tying`` (LoRA of lm_head tied to the embedding's).
"""

from __future__ import annotations

import re

import torch

from adapters.errors import InvalidAdapterError, UnsupportedAdapterError
from adapters.spec import ModelSpec

# PEFT module key -> the engine's name of it (LoRAWeights.vocab keys)
VOCAB_MODULES: dict[str, str] = {"model.embed_tokens": "embed_tokens", "lm_head": "lm_head"}
_EMBEDDING_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>model\.embed_tokens)\.lora_embedding_(?P<ab>[AB])"
                               r"(?:\.default)?$")
_BASE_COPY_RE = re.compile(r"^base_model\.model\.(?P<module>model\.embed_tokens|lm_head)\.base_layer\.weight$")
BASE_COPY = "base_layer"  # the grouped-keys entry of a base layer copy


def vocab_key_parts(key: str) -> tuple[str, str] | None:
    """(module key, "lora_A" | "lora_B" | BASE_COPY) of an embedding-LoRA or base-copy key, else None
    (lm_head's lora_A / lora_B keys are ordinary linear keys)."""
    match = _EMBEDDING_KEY_RE.match(key)
    if match is not None:
        return match.group("module"), f"lora_{match.group('ab')}"
    match = _BASE_COPY_RE.match(key)
    return None if match is None else (match.group("module"), BASE_COPY)


def check_vocab_target(name: str, key: str, config: dict, spec: ModelSpec) -> None:
    """Refuse LoRA on ``key`` (a VOCAB_MODULES key) when this engine cannot serve it exactly."""
    if spec.vocab_size is None:
        raise UnsupportedAdapterError(f"adapter {name!r}: LoRA on {key} needs the base model's vocabulary size, "
                                      "which this ModelSpec does not give (vocab_size=None)")
    if config.get("ensure_weight_tying"):
        raise UnsupportedAdapterError(f"adapter {name!r}: ensure_weight_tying=True (the LoRA of lm_head tied to "
                                      f"that of embed_tokens) is not supported with LoRA on {key}; train the "
                                      "two LoRAs untied (ensure_weight_tying=False)")


def vocab_factor_shapes(name: str, key: str, factors: dict[str, torch.Tensor], rank: int,
                        spec: ModelSpec) -> tuple[tuple[int, int], tuple[int, int]]:
    """Expected (A, B) shapes of ``key``'s LoRA in PEFT's layout, after refusing a resized vocabulary."""
    vocab, hidden = spec.vocab_size, spec.hidden_size
    base = factors.get(BASE_COPY)
    if base is not None and tuple(base.shape) != (vocab, hidden):
        raise _resized(name, f"{key}.base_layer.weight has shape {tuple(base.shape)}", vocab, hidden)
    if key == "model.embed_tokens":
        columns = factors["lora_A"].shape[-1] if factors["lora_A"].dim() == 2 else None
        if columns is not None and columns != vocab:
            raise _resized(name, f"{key}.lora_embedding_A has {columns} columns", vocab, hidden)
        return (rank, vocab), (hidden, rank)
    rows = factors["lora_B"].shape[0] if factors["lora_B"].dim() == 2 else None
    if rows is not None and rows != vocab:
        raise _resized(name, f"{key}.lora_B has {rows} rows", vocab, hidden)
    return (rank, hidden), (vocab, rank)


def _resized(name: str, what: str, vocab: int, hidden: int) -> InvalidAdapterError:
    return InvalidAdapterError(f"adapter {name!r}: {what}, but the base model has a vocabulary of {vocab} tokens "
                               f"of width {hidden}: an adapter trained on a resized vocabulary is not supported")
