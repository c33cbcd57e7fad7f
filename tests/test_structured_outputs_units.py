"""The masks of lora_runner.sample.token_masks and their use by the Sampler, without a model."""

import numpy as np
import pytest
import torch

from lora_runner import SamplingParams
from lora_runner.sample.sampler import Sampler
from lora_runner.sample.token_masks import apply_grammar_bitmask, bad_word_bans, unpack_bitmask

VOCAB = 70  # not a multiple of 32: the last word of a bitmask row is partly past the vocabulary


def _bitmask(allowed_rows: list[set[int]], width: int = 3) -> torch.Tensor:
    words = np.zeros((len(allowed_rows), width), np.uint32)
    for row, ids in enumerate(allowed_rows):
        for t in ids:
            words[row, t // 32] |= np.uint32(1 << (t % 32))
    return torch.from_numpy(words.view(np.int32))


def test_unpack_matches_the_ids_set_bit_31_included():
    allowed = [{0, 31, 32, 63, 69}, set(range(VOCAB))]
    unpacked = unpack_bitmask(_bitmask(allowed), VOCAB)
    assert [set(torch.nonzero(row).flatten().tolist()) for row in unpacked] == allowed


def test_apply_grammar_bitmask_touches_only_its_rows_and_bans_ids_past_its_width():
    logits = torch.randn(3, VOCAB + 40)  # 110 ids, the bitmask covers 96
    before = logits.clone()
    apply_grammar_bitmask(logits, np.array([1]), _bitmask([{5, 95}]))
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [5, 95]


@pytest.mark.parametrize("generated, want", [([], [9]), ([1, 2], [9, 3]), ([2, 1], [9]), ([7, 1, 2], [9, 3])])
def test_bad_word_bans_are_the_last_tokens_of_matched_prefixes(generated, want):
    assert bad_word_bans(generated, [[9], [1, 2, 3], [5, 5]]) == want


def test_the_sampler_masks_its_rows_after_penalties_and_keeps_raw_logprobs():
    sampler = Sampler(VOCAB, "cpu")
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.0, allowed_token_ids=[3, 4])]
    batch = sampler.make_batch(params, [None, torch.Generator().manual_seed(1), None])
    batch.grammar_rows = np.array([0, 1])
    batch.grammar_bitmask = _bitmask([{7}, {8, 9}])
    logits = torch.randn(3, VOCAB)
    out = sampler(logits, batch)
    assert out.token_ids[0] == 7 and out.token_ids[1] in (8, 9) and out.token_ids[2] in (3, 4)
    raw = torch.log_softmax(logits, dim=-1)
    top = raw[0].topk(2).indices.tolist()
    assert set(out.logprobs[0]) == set(top) | {7}
    assert out.logprobs[0][7] == pytest.approx(raw[0, 7].item())
    one = batch.row(1)  # the one-row fallback keeps the row's bitmask
    assert one.grammar_rows.tolist() == [0] and torch.equal(one.grammar_bitmask, batch.grammar_bitmask[1:2])
