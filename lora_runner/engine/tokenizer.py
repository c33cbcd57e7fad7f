"""The model directory's tokenizer (loaded lazily) and its end-of-sequence ids."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

logger = logging.getLogger(__name__)


def eos_token_ids(model_config, model_dir: str | Path) -> frozenset[int]:
    """End-of-sequence ids: config.json's plus generation_config.json's (chat models list several)."""
    ids = set(model_config.eos_token_ids)
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(ids)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class LazyTokenizer:
    """The model dir's tokenizer, loaded with transformers.AutoTokenizer on first use.

    A model dir without tokenizer files has none: encode() raises ValueError, decode() gives "".
    """

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        self._tokenizer = None
        self._backend_decode = None  # the Rust decode, where it is exactly the tokenizer's (see _backend_decode)
        self._loaded = False
        self._lock = threading.Lock()

    def get(self):
        """The transformers tokenizer, or None when the model dir has none."""
        with self._lock:
            if not self._loaded:
                if any((self.model_dir / name).is_file() for name in _TOKENIZER_FILES):
                    from transformers import AutoTokenizer

                    self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
                    self._backend_decode = _backend_decode(self._tokenizer)
                else:
                    logger.info("no tokenizer in %s: token-id prompts only, empty output text", self.model_dir)
                self._loaded = True
            return self._tokenizer

    def vocab(self) -> dict[str, int] | None:
        """The tokenizer's token -> id map; None when the model dir has no tokenizer."""
        tokenizer = self.get()
        return None if tokenizer is None else tokenizer.get_vocab()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens (BOS) the tokenizer adds by itself."""
        tokenizer = self.get()
        if tokenizer is None:
            raise ValueError(f"string prompts need a tokenizer, but {self.model_dir} has none: "
                             "pass the prompt as a list of token ids")
        return list(tokenizer.encode(text))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = True) -> str:
        """Text of `token_ids` ("" without a tokenizer): without special tokens, or with them
        (skip_special_tokens=False), then separated from the text around them by a space unless
        spaces_between_special_tokens=False (vLLM's semantics, whatever the tokenizer's own decode does).
        """
        tokenizer = self.get()
        if tokenizer is None:
            return ""
        if skip_special_tokens:
            if self._backend_decode is not None:
                return self._backend_decode(token_ids, skip_special_tokens=True)
            return tokenizer.decode(token_ids, skip_special_tokens=True)
        return decode_with_special_tokens(tokenizer, token_ids, spaces_between_special_tokens)


def decode_with_special_tokens(tokenizer, token_ids: list[int], spaces_between: bool) -> str:
    """``token_ids`` decoded with their special (and added) tokens: each such token is a piece of its
    own, each run of ordinary tokens between them is decoded as one piece; the pieces are joined by a
    space when ``spaces_between`` (HF's slow tokenizers and vLLM do so), else directly."""
    added = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pieces: list[str] = []
    run: list[int] = []
    for token in token_ids:
        if token in added:
            if run:
                pieces.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            pieces.append(tokenizer.convert_ids_to_tokens(token))
        else:
            run.append(token)
    if run:
        pieces.append(tokenizer.decode(run, skip_special_tokens=False))
    return (" " if spaces_between else "").join(pieces)


def _backend_decode(tokenizer):
    """The Rust tokenizer's decode when ``tokenizer.decode(ids, skip_special_tokens=True)`` is exactly
    that call (a stock fast tokenizer: neither decode nor _decode overridden, no clean-up of spaces),
    else None. It skips transformers' per-call argument conversion, a few microseconds per call, and
    the incremental detokenizer decodes twice per request and step."""
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    cls = type(tokenizer)
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or tokenizer.clean_up_tokenization_spaces:
        return None
    if cls.decode is not PreTrainedTokenizerBase.decode or cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return tokenizer.backend_tokenizer.decode
