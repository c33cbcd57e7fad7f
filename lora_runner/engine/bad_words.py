"""SamplingParams.bad_words -> the token sequences the sampler bans (vLLM's semantics).

Each word is tokenized as written (leading spaces stripped) and once more after a space; the spaced
form counts only where it is a different token sequence of the same length (a word-initial token of
a BPE vocabulary), as in vLLM. The sampler bans a sequence's last token whenever the tokens before it
end the output so far (lora_runner.sample.token_masks.bad_word_bans).
"""

from __future__ import annotations

MAX_BAD_WORD_TOKENS = 64  # longest token sequence of one bad word (its prefix is compared every step)


def bad_words_token_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """The token sequences of `words` for `tokenizer` (transformers); ValueError when the model has no
    tokenizer, a word has too many tokens or a token lies outside the model's vocabulary."""
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer, and this model has none")
    sequences: list[list[int]] = []
    for word in words:
        plain = _encode(tokenizer, word.lstrip(), word, vocab_size)
        sequences.append(plain)
        spaced = _encode(tokenizer, " " + word.lstrip(), word, vocab_size)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def _encode(tokenizer, text: str, word: str, vocab_size: int) -> list[int]:
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"bad word {word!r:.80} has no tokens")
    if len(ids) > MAX_BAD_WORD_TOKENS:
        raise ValueError(f"bad word {word!r:.80} has {len(ids)} tokens, more than {MAX_BAD_WORD_TOKENS}")
    if max(ids) >= vocab_size:
        raise ValueError(f"bad word {word!r:.80} has token {max(ids)}, outside the model's vocabulary "
                         f"[0, {vocab_size})")
    return ids
