"""Incremental detokenization against the oracle tokenizer.decode(all ids), on a byte-level BPE whose
tokens split UTF-8 sequences and on the word-level test tokenizer (which joins tokens with spaces)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_runner.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, OutputText
from factories import MULTIBYTE_CORPUS, make_byte_level_tokenizer, save_tiny_tokenizer


@pytest.fixture(scope="module")
def byte_level():
    return make_byte_level_tokenizer()


@pytest.fixture(scope="module")
def word_level(tmp_path_factory):
    return save_tiny_tokenizer(tmp_path_factory.mktemp("wordtok"), 64)


def decoder_of(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def deltas(tokenizer, ids, chunks=None):
    """Every step's delta for `ids` fed one token (or chunks[i] tokens) at a time, then the flush."""
    detok = IncrementalDetokenizer(decoder_of(tokenizer))
    out, pos = [], 0
    for size in chunks or [1] * len(ids):
        out.append(detok.add(ids[pos:pos + size]))
        pos += size
    out.append(detok.add(ids[pos:]))
    return out, detok.flush()


ids_strategy = st.lists(st.integers(0, 299), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ids=ids_strategy, chunking=st.lists(st.integers(1, 4), max_size=40))
def test_deltas_concatenate_to_the_full_decode_byte_level(byte_level, ids, chunking):
    steps, tail = deltas(byte_level, ids, chunking)
    assert "".join(steps) + tail == byte_level.decode(ids, skip_special_tokens=True)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 63), max_size=30))
def test_deltas_concatenate_to_the_full_decode_word_level(word_level, ids):
    steps, tail = deltas(word_level, ids)
    assert tail == ""  # words never end mid-character: nothing is held back
    assert "".join(steps) == word_level.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", MULTIBYTE_CORPUS)
def test_real_text_streams_whole_characters(byte_level, text):
    ids = byte_level.encode(text)
    steps, tail = deltas(byte_level, ids)
    assert "".join(steps) == text and tail == ""
    assert not any(REPLACEMENT_CHAR in step for step in steps)  # a partial character is never streamed
    assert sum(1 for step in steps if step == "") > 0 or text.isascii()  # some tokens did end mid-character


def test_a_split_character_is_held_back_until_complete(byte_level):
    ids = byte_level.encode("🙂")
    assert len(ids) > 1  # the emoji's 4 bytes are spread over several tokens
    detok = IncrementalDetokenizer(decoder_of(byte_level))
    assert [detok.add([i]) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_flush_reports_an_unfinished_character(byte_level):
    ids = byte_level.encode("a中")[:-1]  # the last byte of 中 missing
    detok = IncrementalDetokenizer(decoder_of(byte_level))
    streamed = "".join(detok.add([i]) for i in ids)
    assert streamed == "a" and detok.flush() == byte_level.decode(ids)[1:]


def test_no_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.add([1, 2, 3]) == "" and detok.flush() == ""


def test_output_text_holds_back_what_a_stop_string_may_still_cut(word_level):
    ids = word_level.encode("the cat sat on the mat")
    text = OutputText(decoder_of(word_level), stop=["on the mat"], holdback=len("on the mat") - 1)
    reported = []
    for token in ids:
        matched = text.add(token)
        reported.append(text.take_delta())
    assert matched == "on the mat" and text.text == "the cat sat "
    assert "".join(reported) == "the cat sat "  # "on the" was never reported, then cut


@pytest.fixture(scope="module")
def byte_level_model(tmp_path_factory):
    """A tiny Llama whose vocabulary is the byte-level BPE's (300 tokens)."""
    from factories import save_tiny_model

    path = tmp_path_factory.mktemp("byte-level-model")
    save_tiny_model(path, "llama", seed=1, tokenizer=False, vocab_size=300)
    make_byte_level_tokenizer().save_pretrained(str(path))
    return str(path)


def test_engine_streams_whole_characters_and_adds_up(byte_level_model, byte_level):
    """Sampled tokens of a byte-level vocabulary end mid-character all the time: every running
    output's delta ends on a whole character, and the deltas add up to the decode of all ids."""
    from lora_runner import LLMEngine, SamplingParams

    engine = LLMEngine(byte_level_model, device="cpu", max_num_seqs=4, max_model_len=64)
    for i in range(4):
        engine.add_request(f"r{i}", byte_level.encode("中文 café"),
                           SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True))
    deltas, final = {f"r{i}": [] for i in range(4)}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            completion = output.outputs[0]
            deltas[output.request_id].append(completion.text_delta)
            if output.finished:
                final[output.request_id] = completion
            else:
                assert not completion.text.endswith(REPLACEMENT_CHAR)
    held_back = 0
    for request_id, completion in final.items():
        whole = byte_level.decode(completion.token_ids, skip_special_tokens=True)
        assert "".join(deltas[request_id]) == completion.text == whole
        held_back += sum(d == "" for d in deltas[request_id][:-1])
    assert held_back > 0  # some sampled token did end mid-character
