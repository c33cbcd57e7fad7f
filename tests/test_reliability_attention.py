"""Issue 23 item 11: a long prompt must not stall everyone's decode on CPU.

The torch attention path used to pad every sequence of a step to the step's longest query and
context: one long prefill chunk beside 8 decodes made each decode compute (and gather) the chunk's
whole [query x context] rectangle. These tests count the attention work instead of timing it: every
scaled_dot_product_attention call (and every score matmul of the soft-capped path) is recorded, and
the scores computed must stay within a small factor of sum over sequences of query_len x seq_len.
Exactness: the grouped batch matches each sequence run alone and the float64 reference.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lora_runner.model import attention, llama
from lora_runner.model.attention import length_groups, paged_attention, write_kv
from lora_runner.model.forward_context import AttentionMetadata
from lora_runner.sampling_params import SamplingParams
from engine_support import assert_exact, make_engine, run_to_completion
from test_attention import _batch, _reference

HEAD_DIM = 8
WORK_FACTOR = 2.0  # scores computed <= this x the step's own sum(query_len * seq_len) per head
# one prefill chunk of 384 new tokens on 384 cached ones, beside 8 decodes of short contexts
LONG_PREFILL = ([384] + [1] * 8, [768] + [5, 9, 12, 17, 20, 26, 31, 40])


class ScoreCounter:
    """Records the score elements (batch x heads x queries x keys) of every attention call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.elements = 0
        self.calls = 0
        sdpa, matmul = torch.nn.functional.scaled_dot_product_attention, torch.matmul

        def counted_sdpa(q, k, v, *args, **kwargs):
            self.elements += q.shape[:-1].numel() * k.shape[-2]
            self.calls += 1
            return sdpa(q, k, v, *args, **kwargs)

        def counted_matmul(a, b, *args, **kwargs):
            out = matmul(a, b, *args, **kwargs)
            if b.shape[-2] == HEAD_DIM:  # contracts head_dim: q @ k.T, the scores (probs @ v contracts keys)
                self.elements += out.numel()
                self.calls += 1
            return out

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted_sdpa)
        monkeypatch.setattr(torch, "matmul", counted_matmul)


def own_scores(attn: AttentionMetadata, num_heads: int) -> int:
    """sum over sequences of query_len x seq_len, times the heads: what an unpadded kernel computes."""
    query_lens = (attn.query_start_loc[1:] - attn.query_start_loc[:-1]).long()
    return num_heads * int((query_lens * attn.seq_lens.long()).sum())


def run_case(query_lens, seq_lens, heads=(4, 2), window=None, softcap=None, num_padding=0, seed=0):
    """(output of the whole batch, float64 reference, query, kv_layer, metadata)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    kv_layer, attn, new_k, new_v, full_k, full_v = _batch(
        gen, query_lens, seq_lens, 16, 128, num_kv_heads, HEAD_DIM, num_padding, torch.float32, "cpu")
    query = torch.randn(sum(query_lens) + num_padding, num_heads, HEAD_DIM, generator=gen)
    scale = 1 / math.sqrt(HEAD_DIM)
    write_kv(kv_layer, new_k, new_v, attn.slot_mapping)
    out = paged_attention(query, kv_layer, attn, scale, sliding_window=window, backend="torch", softcap=softcap)
    expected = _reference(query, full_k, full_v, query_lens, scale, window, softcap)
    return out, expected, query, kv_layer, attn


@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("mix", ["long_prefill", "long_decode", "two_prefills"])
def test_decodes_do_not_pay_for_a_long_sequence(monkeypatch, mix, softcap):
    """A long prefill chunk, a long-context decode or two prefills of very different sizes beside
    8 short decodes: the scores computed stay within WORK_FACTOR of each sequence's own."""
    query_lens, seq_lens = {
        "long_prefill": LONG_PREFILL,
        "long_decode": ([1] * 9, [1000, 5, 9, 12, 17, 20, 26, 31, 40]),
        "two_prefills": ([300, 6] + [1] * 8, [300, 6, 5, 9, 12, 17, 20, 26, 31, 40]),
    }[mix]
    counter = ScoreCounter(monkeypatch)
    out, expected, _, _, attn = run_case(query_lens, seq_lens, softcap=softcap)
    assert counter.calls > 0
    assert counter.elements <= WORK_FACTOR * own_scores(attn, 4), (
        f"{counter.elements} scores computed for {own_scores(attn, 4)} of the sequences' own")
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_similar_lengths_stay_one_call(monkeypatch):
    """Decodes of similar context lengths are still one padded call: no per-sequence loop."""
    counter = ScoreCounter(monkeypatch)
    run_case([1] * 16, list(range(40, 56)))
    assert counter.calls == 1


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 0.5), (40, 0.5)])
def test_mixed_batch_matches_each_sequence_alone(heads, window, softcap):
    """A long prefill chunk on cached context, a fresh prompt, 8 decodes (one long) and 2 graph
    padding tokens: every row equals that sequence run alone and the float64 reference; padding
    rows are zero. GQA, sliding windows and Gemma 2's soft cap included."""
    query_lens = [200, 7] + [1] * 8
    seq_lens = [450, 7, 5, 9, 12, 17, 20, 26, 31, 500]
    out, expected, query, kv_layer, attn = run_case(query_lens, seq_lens, heads, window, softcap, num_padding=2,
                                                     seed=sum(heads) + (window or 0))
    num_real = sum(query_lens)
    torch.testing.assert_close(out[:num_real].double(), expected, atol=1e-5, rtol=1e-5)
    assert (out[num_real:] == 0).all(), "padding tokens get zeros"
    starts = attn.query_start_loc.tolist()
    for seq, (start, end) in enumerate(zip(starts, starts[1:])):
        alone = AttentionMetadata(slot_mapping=attn.slot_mapping[start:end],
                                  query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
                                  seq_lens=attn.seq_lens[seq:seq + 1], block_tables=attn.block_tables[seq:seq + 1],
                                  max_query_len=end - start, max_seq_len=int(attn.seq_lens[seq]))
        single = paged_attention(query[start:end], kv_layer, alone, 1 / math.sqrt(HEAD_DIM), sliding_window=window,
                                 backend="torch", softcap=softcap)
        torch.testing.assert_close(out[start:end], single, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_bound_and_cover(seed):
    """Random steps: the groups partition the sequences, each within the padding bound."""
    rng = np.random.default_rng(seed)
    num_seqs = int(rng.integers(1, 40))
    query_lens = np.where(rng.random(num_seqs) < 0.7, 1, rng.integers(1, 600, num_seqs))
    seq_lens = query_lens + rng.integers(0, 3000, num_seqs) * (rng.random(num_seqs) < 0.8)
    groups = length_groups(query_lens, seq_lens)
    if groups is None:
        groups = [np.arange(num_seqs)]
    assert sorted(np.concatenate(groups).tolist()) == list(range(num_seqs))
    for seqs in groups:
        padded = len(seqs) * query_lens[seqs].max() * seq_lens[seqs].max()
        assert padded <= attention.MAX_PADDING * (query_lens[seqs] * seq_lens[seqs]).sum()


def test_engine_long_prompt_beside_decoding_streams(monkeypatch, engine_checkpoint, greedy_oracle):
    """Through the engine: 8 streams decode while a 400-token prompt is prefilled in chunks beside
    them. Every layer's attention of every step stays within the bound, and every stream (the long
    prompt's too) gets exactly transformers' greedy tokens."""
    model_dir, hf, _ = engine_checkpoint
    engine = make_engine(model_dir, max_num_seqs=9, max_model_len=512, max_num_batched_tokens=160, block_size=16,
                         poison=["kv_cache"])
    work = []
    original = llama.paged_attention

    def counted(query, kv_layer, attn, *args, **kwargs):
        counter.elements = 0
        out = original(query, kv_layer, attn, *args, **kwargs)
        work.append((counter.elements, own_scores(attn, query.shape[1])))
        return out

    counter = ScoreCounter(monkeypatch)
    monkeypatch.setattr(llama, "paged_attention", counted)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    rng = np.random.default_rng(0)
    prompts = {f"stream-{i}": rng.integers(4, 256, 5 + 3 * i).tolist() for i in range(8)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    for _ in range(3):  # the streams are decoding when the long prompt arrives
        assert not any(output.finished for output in engine.step())
    prompts["long"] = rng.integers(4, 256, 400).tolist()
    done = run_to_completion(engine, [("long", prompts["long"], params)])
    assert len(work) > 0
    worst = max(computed / own for computed, own in work)
    assert worst <= WORK_FACTOR, f"a step's attention computed {worst:.1f}x its sequences' own scores"
    assert sorted(done) == sorted(prompts)
    for request_id, prompt in prompts.items():
        assert_exact(done[request_id], hf, prompt, greedy_oracle, max_tokens=12)
