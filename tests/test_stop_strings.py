"""Stop strings, include_stop_str_in_output and min_tokens through LLMEngine, against an oracle: the
greedy tokens of transformers, decoded whole, cut where the first stop string is completed."""

import random

import pytest
import torch

from lora_runner import LLMEngine, SamplingParams
from lora_runner.core.request import Request
from lora_runner.engine.output_processor import OutputProcessor

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def engine(engine_checkpoint):
    path, _, _ = engine_checkpoint
    return LLMEngine(path, device="cpu", max_num_seqs=8, max_model_len=64, block_size=4)


def run(engine, requests):
    """requests: {id: (prompt, params)} -> {id: (final output, the text deltas of every output)}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    deltas, final = {i: [] for i in requests}, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas[output.request_id].append(output.outputs[0].text_delta)
            if output.finished:
                final[output.request_id] = output.outputs[0]
    return {i: (final[i], deltas[i]) for i in requests}


def oracle(decode, tokens, stops, include):
    """(text, number of tokens generated, matched stop) as if decoding the whole greedy output and
    cutting at the stop string whose first occurrence ends first (the longest at equal ends)."""
    full = decode(tokens)
    hits = [(full.find(s) + len(s), -len(s), s) for s in stops if s in full]
    if not hits:
        return full, len(tokens), None
    end, neg_len, stop = min(hits)
    count = next(k for k in range(1, len(tokens) + 1) if len(decode(tokens[:k])) >= end)
    return full[:end if include else end + neg_len], count, stop


def stops_from(text, rng):
    """1-3 stop strings cut from the text (often crossing token boundaries)."""
    stops = []
    for _ in range(rng.randint(1, 3)):
        start = rng.randrange(len(text))
        stops.append(text[start:start + rng.randint(1, 6)])
    return stops


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_match_the_oracle(engine, engine_checkpoint, greedy_oracle, seed):
    _, hf, _ = engine_checkpoint
    rng = random.Random(seed)
    decode = engine.tokenizer.decode
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    greedy = [greedy_oracle(hf, p, MAX_TOKENS)[0] for p in prompts]
    requests, expected = {}, {}
    for i, (prompt, tokens) in enumerate(zip(prompts, greedy)):
        stops, include = stops_from(decode(tokens), rng) if i else ["#never#"], rng.random() < 0.5
        requests[f"s{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                    stop=stops, include_stop_str_in_output=include))
        expected[f"s{i}"] = (*oracle(decode, tokens, stops, include), tokens)
        requests[f"plain{i}"] = (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    results = run(engine, requests)
    for request_id, (text, count, stop, tokens) in expected.items():
        output, deltas = results[request_id]
        assert output.text == text and "".join(deltas) == text, (request_id, requests[request_id][1].stop)
        assert output.token_ids == tokens[:count]
        assert (output.finish_reason, output.stop_reason) == (("stop", stop) if stop else ("length", None))
    for i, tokens in enumerate(greedy):  # requests without stop settings: unchanged
        output, deltas = results[f"plain{i}"]
        assert output.token_ids == tokens and output.text == decode(tokens) == "".join(deltas)
        assert output.stop_reason is None


def test_streamed_text_never_shows_what_a_stop_string_cuts(engine, engine_checkpoint, greedy_oracle):
    _, hf, _ = engine_checkpoint
    prompt = [40, 41, 42]
    tokens = greedy_oracle(hf, prompt, MAX_TOKENS)[0]
    full = engine.tokenizer.decode(tokens)
    words = full.split(" ")
    stop = " ".join(words[3:6])  # spans three tokens: earlier steps end in a prefix of it
    results = run(engine, {"r": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                                        stop=[stop]))})
    output, deltas = results["r"]
    assert output.text == full[:full.index(stop)] == "".join(deltas)
    assert output.token_ids == tokens[:6] and output.stop_reason == stop


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_ids_text_is_in_the_output_only_when_asked(engine, engine_checkpoint, greedy_oracle, include):
    """vLLM: the text of the stop token id that ended a request is left out of `text` and of the stream
    unless include_stop_str_in_output (its id stays in token_ids)."""
    _, hf, _ = engine_checkpoint
    prompt = [40, 41, 42]
    tokens = greedy_oracle(hf, prompt, MAX_TOKENS)[0]
    stop_id = tokens[4]  # an ordinary word: its text is not empty
    end = tokens.index(stop_id) + 1
    assert engine.tokenizer.decode(tokens[end - 1:end]).strip()
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop_token_ids=[stop_id],
                            include_stop_str_in_output=include)
    output, deltas = run(engine, {"r": (prompt, params)})["r"]
    want = engine.tokenizer.decode(tokens[:end] if include else tokens[:end - 1])
    assert output.token_ids == tokens[:end] and output.stop_reason == stop_id
    assert output.text == want == "".join(deltas)


@torch.inference_mode()
def _masked_greedy(model, prompt, max_tokens, banned, min_tokens, stops):
    """Greedy by repeated full forwards; `banned` ids masked while under min_tokens, as vLLM does;
    stops at a token in `stops` once min_tokens were generated."""
    ids, out = list(prompt), []
    for _ in range(max_tokens):
        logits = model(torch.tensor([ids])).logits[0, -1].double()  # [V]
        if len(out) < min_tokens:
            logits[sorted(banned)] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
        if len(out) >= min_tokens and token in stops:
            break
    return out


def test_min_tokens_masks_eos_and_stop_ids_and_defers_stop_strings(engine, engine_checkpoint, greedy_oracle):
    _, hf, _ = engine_checkpoint
    prompt = [7, 8, 9, 10]
    tokens = greedy_oracle(hf, prompt, MAX_TOKENS)[0]
    decode = engine.tokenizer.decode
    early = decode(tokens[:1])  # the first token's text: a stop string completed at once
    min_tokens = 5
    stop_ids = {tokens[0], tokens[min_tokens - 1]}
    requests = {
        "str": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[early],
                                       min_tokens=min_tokens)),
        "id": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                      stop_token_ids=sorted(stop_ids), min_tokens=min_tokens)),
        "eos": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=min_tokens)),
        "eos-ignored": (prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               min_tokens=min_tokens)),
    }
    saved = engine.eos_token_ids
    engine.eos_token_ids = {tokens[0]}
    try:
        results = run(engine, requests)
    finally:
        engine.eos_token_ids = saved
    # EOS and stop ids are masked from sampling until min_tokens: the greedy path changes at once
    want_id = _masked_greedy(hf, prompt, MAX_TOKENS, stop_ids, min_tokens, stop_ids)
    assert results["id"][0].token_ids == want_id and want_id[0] != tokens[0]
    assert not stop_ids & set(want_id[:min_tokens])
    want_eos = _masked_greedy(hf, prompt, MAX_TOKENS, {tokens[0]}, min_tokens, {tokens[0]})
    assert results["eos"][0].token_ids == want_eos
    assert results["eos-ignored"][0].token_ids == tokens  # ignore_eos: nothing to mask
    # stop strings are not masked (text, not ids): before min_tokens the new text is just not searched
    later = [k for k in range(min_tokens - 1, MAX_TOKENS)
             if early in decode(tokens[:k + 1])[max(0, len(decode(tokens[:k])) - len(early) + 1):]]
    assert results["str"][0].token_ids == tokens[:later[0] + 1 if later else MAX_TOKENS]
    assert all(len(results[i][0].token_ids) >= min_tokens for i in requests)


def test_output_processor_cuts_across_tokens_and_holds_back():
    """Without a model: a decode that joins ids with spaces; the stop string spans two tokens."""
    processor = OutputProcessor(lambda ids: " ".join(map(str, ids)), eos_token_ids=(), max_model_len=64)
    request = Request("r", [1, 2], SamplingParams(stop=["6 7"]), arrival=0)
    assert processor.append(request, [5]) is None
    assert processor.completion(request).text_delta == ""  # the last 2 characters are held back
    assert processor.append(request, [6]) is None
    assert processor.completion(request).text_delta == "5"  # " 6" may still be the stop string
    assert processor.append(request, [7]) == "stop" and request.stop_reason == "6 7"
    request.finish("stop")
    final = processor.completion(request)
    assert (final.text, final.text_delta, final.stop_reason) == ("5 ", " ", "6 7")


@pytest.mark.parametrize("fields,name", [
    (dict(stop=[""]), "stop"), (dict(stop=[3]), "stop"), (dict(stop="x" * 257), "stop"),
    (dict(stop=["a"] * 65), "stop"), (dict(stop={"a": 1}), "stop"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=17), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
])
def test_bad_stop_settings_raise_naming_the_field(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_stop_settings_are_copied_and_checked_again_at_add_request(engine):
    params = SamplingParams(stop="ab", max_tokens=4)
    assert params.stop == ["ab"] and SamplingParams(stop=None).stop == []
    copy = params.clone()
    params.stop.append("cd")
    assert copy.stop == ["ab"]
    params.stop = [""]  # changed after construction: add_request checks its copy
    with pytest.raises(ValueError, match="stop"):
        engine.add_request("bad", [5, 6], params)
    assert not engine.has_unfinished_requests()
