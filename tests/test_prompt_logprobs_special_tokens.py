"""skip_special_tokens / spaces_between_special_tokens (vLLM's semantics) through the engine's own output
path: OutputProcessor, the incremental detokenizer and LazyTokenizer's decode, on the word-level tokenizer."""

from __future__ import annotations

import pytest
from factories import save_tiny_tokenizer

from lora_runner import SamplingParams
from lora_runner.core.request import Request
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.engine.tokenizer import LazyTokenizer

WORDS = ["the", "<s>", "cat", "<pad>", "dog", "<unk>"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("specials")
    save_tiny_tokenizer(path, 64)
    return LazyTokenizer(path)


@pytest.mark.parametrize("skip,spaces,want", [
    (True, True, "the cat dog"),
    (True, False, "the cat dog"),  # spaces matter only where special tokens stay
    (False, True, "the <s> cat <pad> dog <unk>"),
    (False, False, "the<s>cat<pad>dog<unk>"),
])
def test_output_text_keeps_special_tokens_as_asked(tokenizer, skip, spaces, want):
    ids = [tokenizer.get().convert_tokens_to_ids(word) for word in WORDS]
    processor = OutputProcessor(lambda token_ids, **options: tokenizer.decode(token_ids, **options), (), 1000)
    params = SamplingParams(max_tokens=50, ignore_eos=True, skip_special_tokens=skip,
                            spaces_between_special_tokens=spaces)
    request = Request("r", [5], params, arrival=0)
    streamed = ""
    for token in ids:  # one token a step, as the engine appends them
        assert processor.append(request, [token]) is None
        streamed += processor.completion(request).text_delta
    processor.finish(request, "length")
    final = processor.completion(request)
    assert streamed + final.text_delta == final.text == want
    assert tokenizer.decode(ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces) == want


def test_special_token_fields_are_checked():
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        with pytest.raises(ValueError, match=f"{name} must be True or False"):
            SamplingParams(**{name: 1})
