"""LazyTokenizer.decode: the Rust fast path gives exactly what tokenizer.decode(ids, skip_special_tokens=True) gives."""

import random

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from factories import make_byte_level_tokenizer, save_tiny_tokenizer
from lora_runner.engine.tokenizer import LazyTokenizer, _backend_decode


def punctuated_tokenizer(path, clean_up):
    """A word-level tokenizer with punctuation, where transformers' clean-up of spaces changes the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>", "hello", "world", ".", ",", "!", "'s",
                                             "n't", "do"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>", clean_up_tokenization_spaces=clean_up)
    fast.save_pretrained(str(path))


@pytest.mark.parametrize("kind", ["word-level", "byte-level", "clean-up", "no-clean-up"])
def test_decode_equals_the_tokenizers_decode(tmp_path, kind):
    if kind == "word-level":
        save_tiny_tokenizer(tmp_path, 64)
    elif kind == "byte-level":
        make_byte_level_tokenizer().save_pretrained(str(tmp_path))
    else:
        punctuated_tokenizer(tmp_path, clean_up=kind == "clean-up")
    lazy, oracle = LazyTokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    vocab = len(oracle)
    rng = random.Random(0)
    for _ in range(200):  # specials included: they are skipped alike
        ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
        assert lazy.decode(ids) == oracle.decode(ids, skip_special_tokens=True), ids
    # the fast path is taken exactly where it cannot differ: without transformers' clean-up of spaces
    assert (lazy._backend_decode is None) == (kind == "clean-up")
    if kind == "clean-up":  # where the clean-up matters, the tokenizer's own decode is kept
        assert lazy.decode([4, 6]) == "hello." != oracle.backend_tokenizer.decode([4, 6])


def test_a_tokenizer_that_overrides_decode_keeps_its_own(tmp_path):
    save_tiny_tokenizer(tmp_path, 64)

    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    assert _backend_decode(PreTrainedTokenizerFast.from_pretrained(str(tmp_path))) is not None
    assert _backend_decode(Shouting.from_pretrained(str(tmp_path))) is None
