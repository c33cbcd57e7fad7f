"""SamplingParams' checks of the fields that name token ids or count logprobs: allowed_token_ids,
bad_words, logit_bias, logprobs and prompt_logprobs (vLLM's -1: the whole vocabulary).

Each raises ValueError naming the field; the engine's limits (its vocabulary, max_logprobs) are
given where known (``SamplingParams.validate``), else only the type and int32 range are checked.
"""

from __future__ import annotations

import math

MAX_COUNT = 2**31 - 1  # most top_k, max_tokens, min_tokens, logprobs and largest token id (fits int32)
MAX_ALLOWED_TOKEN_IDS = 1 << 20  # longest allowed_token_ids list (a vocabulary of a million ids)
MAX_LOGIT_BIAS = 1 << 20  # most logit_bias entries (each is added to its row's logits every step)
MAX_BIAS = 100.0  # logit_bias values lie in [-MAX_BIAS, MAX_BIAS], as in OpenAI's API
MAX_BAD_WORDS = 256  # most bad_words one request may give (each is matched every step)
MAX_BAD_WORD_CHARS = 256  # longest bad word
WHOLE_VOCABULARY = -1  # logprobs / prompt_logprobs asking for every token of the vocabulary (vLLM's)


def is_int(value) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_real(name: str, value, what: str) -> None:
    """ValueError unless `value` is an int or float (not a bool) that converts to a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        float(value)
    except OverflowError:  # an int too large for a float
        raise ValueError(f"{name} must be {what}, got an integer of {value.bit_length()} bits") from None


def check_logprob_counts(params, max_logprobs: int | None, vocab_size: int | None) -> None:
    """logprobs and prompt_logprobs: None, -1 (the whole vocabulary) or a count in [0, MAX_COUNT], at
    most max_logprobs (None or -1: no cap, as vLLM's --max-logprobs -1) and the vocabulary size."""
    if max_logprobs == WHOLE_VOCABULARY:
        max_logprobs = None
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is None:
            continue
        if not is_int(value) or not WHOLE_VOCABULARY <= value <= MAX_COUNT:
            raise ValueError(f"{name} must be None or an integer in [0, {MAX_COUNT}] (or -1: the whole vocabulary), "
                             f"got {value!r}")
        asked = f"{name}={value}"
        if value == WHOLE_VOCABULARY:
            if vocab_size is None:
                continue
            value, asked = vocab_size, f"{name}=-1 (the whole vocabulary, {vocab_size})"
        for limit, what in ((max_logprobs, "the engine's max_logprobs"), (vocab_size, "the vocabulary size")):
            if limit is not None and value > limit:
                raise ValueError(f"{asked} is over {what} ({limit})")


def whole_vocabulary_counts(params, vocab_size: int) -> None:
    """In place: logprobs / prompt_logprobs of -1 become `vocab_size` (the engine's private copy of
    checked params, so that every later stage counts tokens)."""
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) == WHOLE_VOCABULARY:
            setattr(params, name, vocab_size)


def check_token_filters(params, vocab_size: int | None) -> None:
    """allowed_token_ids, bad_words and logit_bias (ids in the vocabulary when its size is known)."""
    top = MAX_COUNT if vocab_size is None else vocab_size - 1
    where = "the model's vocabulary" if vocab_size is not None else "int32"
    ids = params.allowed_token_ids
    if ids is not None:
        if not isinstance(ids, list) or not 0 < len(ids) <= MAX_ALLOWED_TOKEN_IDS:
            raise ValueError(f"allowed_token_ids must be None or a list of 1..{MAX_ALLOWED_TOKEN_IDS} token ids")
        if any(not is_int(t) or not 0 <= t <= top for t in ids):
            raise ValueError(f"allowed_token_ids must be integers in [0, {top}] ({where}), got {list(ids)!r:.200}")
    words = params.bad_words
    if words is not None:
        if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words must be None or a list of at most {MAX_BAD_WORDS} strings")
        for word in words:
            if not isinstance(word, str) or not 0 < len(word.strip()) or len(word) > MAX_BAD_WORD_CHARS:
                raise ValueError(f"bad_words must hold non-blank strings of at most {MAX_BAD_WORD_CHARS} "
                                 f"characters, got {word!r:.80}")
    _check_logit_bias(params.logit_bias, top, where)


def _check_logit_bias(bias, top: int, where: str) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must be None or a dict token id -> bias of at most {MAX_LOGIT_BIAS} entries")
    for token, value in bias.items():
        if not is_int(token) or not 0 <= token <= top:
            raise ValueError(f"logit_bias keys must be token ids in [0, {top}] ({where}), got {token!r:.40}")
        what = f"a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}]"
        check_real(f"logit_bias[{token}]", value, what)
        if not (math.isfinite(value) and -MAX_BIAS <= value <= MAX_BIAS):
            raise ValueError(f"logit_bias[{token}] must be {what}, got {value}")
