"""The batch-invariant mode's sampler and router ops on CUDA, run as their interpreted twins on CPU tensors:
the row scan (punica_kernels.invariant_sampling.cumsum, the top-p mass) and the ordered selection (top /
argmax, the lowest column on ties) give a row the same bits alone and among 1..64 random companion rows,
equal a float64 reference, write every output entry; the mode's top-k / top-p sort is stable; the Sampler,
the prompt logprobs, speculative decoding's rejection sampler and the MoE router take them in the mode (and
a row's sampled token, logprobs and expert outputs then do not depend on its companions; the MoE experts'
GEMMs are the fixed-config GEMM); and on a lent GPU seeded top-p sampling is bitwise invariant.
"""

from __future__ import annotations

import pytest
import torch

from lora_runner.sample.sampler import Sampler
from lora_runner.sampling_params import SamplingParams
from punica_kernels import invariant, invariant_sampling, invariant_triton

COMPANIONS = (1, 2, 3, 5, 8, 13, 16, 21, 33, 47, 63, 64)  # companion rows beside the fixed one
WIDTHS = (1000, 2501)  # a multiple of 4 and not: rows start at every alignment
DTYPES = [torch.float32, torch.float16]


def _probs_rows(gen: torch.Generator, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, width] sorted-probability-like rows: each keeps a random number of leading entries (a
    top-k cut: the rest 0), descending, summing to about 1, over many binades (so that even half inputs do
    not sum exactly in fp32, and another order shows)."""
    rows = torch.softmax(torch.randn(num_rows, width, generator=gen) * 4, -1).sort(dim=-1, descending=True).values
    kept = torch.randint(1, width + 1, (num_rows, 1), generator=gen)
    rows = torch.where(torch.arange(width) < kept, rows, 0.0)
    return (rows / rows.sum(-1, keepdim=True)).to(dtype)


def _tied_rows(gen: torch.Generator, num_rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_rows, width] rows of few distinct values (ties everywhere, as bf16 logits have), some -inf."""
    rows = torch.randint(-6, 3, (num_rows, width), generator=gen).to(dtype) / 2
    return rows.masked_fill(torch.rand(num_rows, width, generator=gen) < 0.2, float("-inf"))


def _among(gen: torch.Generator, row: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(rows with `row` put at a random position, that position)."""
    position = int(torch.randint(rows.shape[0] + 1, (1,), generator=gen))
    return torch.cat([rows[:position], row[None], rows[position:]]), position


def _bits(values: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers (torch.equal calls NaN unequal to itself)."""
    return values.view(torch.int32 if values.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cumsum_row_bits_do_not_depend_on_the_batch(dtype):
    """The top-p mass: a row alone and among random rows (other cuts, other widths of non-zero mass) gives the
    same float32 bits; every output entry written (NaN-poisoned buffer); float64's running sum within fp32's error."""
    gen = torch.Generator().manual_seed(10)
    for width in WIDTHS:
        row = _probs_rows(gen, 1, width, dtype)[0]
        out = torch.full((1, width), float("nan"))  # float32 whatever the input
        alone = invariant_sampling.cumsum(row[None], out)[0]
        assert not alone.isnan().any()
        torch.testing.assert_close(alone.double(), row.double().cumsum(-1), rtol=1e-5, atol=1e-5)
        for size in COMPANIONS:
            rows, position = _among(gen, row, _probs_rows(gen, size, width, dtype))
            assert torch.equal(invariant_sampling.cumsum(rows)[position], alone), (width, size)


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_is_a_total_order_and_its_row_bits_do_not_depend_on_the_batch(dtype):
    """Top-k and argmax over rows full of ties, -inf and a NaN: exactly a stable descending sort's first k
    (values and ids: NaN first, then ties by ascending id) in float64, the same alone and among random rows,
    every output entry written."""
    gen = torch.Generator().manual_seed(11)
    for width in WIDTHS:
        row = _tied_rows(gen, 1, width, dtype)[0]
        row[width // 3] = float("nan")
        values, indices = torch.full((1, 20), float("nan"), dtype=dtype), torch.full((1, 20), -1)
        invariant_sampling.top(row[None], 20, (values, indices))
        want = torch.sort(row.double(), descending=True, stable=True)
        assert torch.equal(indices[0], want.indices[:20]), (indices, want.indices[:20])
        torch.testing.assert_close(values[0].double(), want.values[:20], rtol=0, atol=0, equal_nan=True)
        assert int(invariant_sampling.argmax(row[None])) == int(row.double().max(-1).indices) == width // 3
        for size in COMPANIONS:
            rows, position = _among(gen, row, _tied_rows(gen, size, width, dtype))
            got = invariant_sampling.top(rows, 3)
            assert torch.equal(got[1][position], indices[0, :3]), (width, size)
            assert torch.equal(_bits(got[0][position]), _bits(values[0, :3]))  # NaN's bits too


def test_argmax_takes_the_first_maximum_of_each_row():
    """argmax of rows with their maximum at many places (and all -inf): the lowest id, as torch's max."""
    gen = torch.Generator().manual_seed(12)
    rows = _tied_rows(gen, 40, 1537, torch.float32)
    rows[0] = float("-inf")
    rows[1, 1536] = 9.0  # the maximum in the last column only
    assert torch.equal(invariant_sampling.argmax(rows), rows.max(dim=-1).indices)


def test_the_modes_sort_keeps_tied_ids_in_ascending_order(monkeypatch):
    """The top-k / top-p sort in the mode on CUDA is stable: tied logits in ascending id order, so which of
    them a top-k cut keeps is set by the row alone (an unstable sort leaves it to the algorithm)."""
    monkeypatch.setattr(invariant, "uses_triton", lambda x: True)
    rows = _tied_rows(torch.Generator().manual_seed(16), 4, 5000, torch.float32)
    with invariant.active():
        values, order = invariant.sort_descending(rows)
    want = torch.sort(rows, dim=-1, descending=True, stable=True)
    assert torch.equal(order, want.indices) and torch.equal(values, want.values)


@pytest.fixture
def interpreted_mode(monkeypatch):
    """The mode with its CUDA kernels run by CPU tensors (their interpreted twins), counting the calls by
    kernel ("top" by k: "top1" is an argmax; "softmax" and "log_softmax")."""
    calls: dict[str, int] = {}
    for module, name in ((invariant_sampling, "cumsum"), (invariant_sampling, "top"), (invariant_triton, "softmax"),
                         (invariant_triton, "matmul")):
        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            key = _name
            if _name == "top":
                key = f"top{args[1]}"
            elif _name == "softmax" and (args[1] if len(args) > 1 else kwargs.get("log", False)):
                key = "log_softmax"
            calls[key] = calls.get(key, 0) + 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    monkeypatch.setattr(invariant, "uses_triton", lambda x: True)
    with invariant.active():
        yield calls


VOCAB = 1501
FIXED = SamplingParams(temperature=0.9, top_p=0.8, top_k=400, seed=5, logprobs=5)


def _sample_fixed(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], position: int):
    """(token, logprob dict) of row `position` of one sampler call; every seeded row gets a fresh generator."""
    generators = [None if p.seed is None else torch.Generator(logits.device).manual_seed(p.seed) for p in params]
    output = sampler(logits, sampler.make_batch(params, generators))
    return output.token_ids[position], output.logprobs[position]


def _companion_params(gen: torch.Generator, size: int) -> list[SamplingParams]:
    choices = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, top_p=0.5),
               SamplingParams(temperature=0.7, top_k=3, seed=1), SamplingParams(temperature=1.2, min_p=0.1, seed=2)]
    return [choices[int(i)] for i in torch.randint(len(choices), (size,), generator=gen)]


def test_the_sampler_in_the_mode_takes_the_row_kernels_and_a_row_does_not_depend_on_the_batch(interpreted_mode):
    """A seeded top-k/top-p row with logprobs (logits of few distinct values: ties at every cut) alone and among
    greedy, top-p, top-k and min-p rows: the same token and logprob bits; the kernels were the ones called;
    and the token and logprobs are the default sampler's (the mode changes the order of sums, not the math)."""
    gen = torch.Generator().manual_seed(13)
    sampler = Sampler(VOCAB, "cpu")
    row = torch.randint(-40, 40, (VOCAB,), generator=gen).float() / 8
    alone = _sample_fixed(sampler, row[None], [FIXED], 0)
    assert set(interpreted_mode) == {"cumsum", "top1", "top5", "softmax", "log_softmax"}, interpreted_mode
    for size in (1, 3, 8, 17):
        logits, position = _among(gen, row, torch.randint(-40, 40, (size, VOCAB), generator=gen).float() / 8)
        params = _companion_params(gen, size)
        params.insert(position, FIXED)
        assert _sample_fixed(sampler, logits, params, position) == alone, size
    with invariant.active(False):  # (the ids of tied top logprobs are torch's choice there: compared by value)
        token, logprobs = _sample_fixed(sampler, row[None], [FIXED], 0)
    assert token == alone[0] and abs(logprobs[token] - alone[1][token]) < 1e-5
    assert max(logprobs.values()) == pytest.approx(max(alone[1].values()), abs=1e-5)


def test_prompt_logprobs_in_the_mode_take_the_row_kernels(interpreted_mode):
    """A chunk's prompt logprobs in the mode: the row log-softmax and the ordered top-k (tied ids ascending),
    the same dicts whether the chunk is scored alone or after another request's rows."""
    import numpy as np

    from lora_runner.sample.prompt_logprobs import PromptSpan, score_spans

    gen = torch.Generator().manual_seed(18)
    fixed = torch.randint(-40, 40, (4, VOCAB), generator=gen).float() / 8  # [4, V] its positions' logits
    targets = np.array([3, 9, 27, 81])

    def score(before: int) -> list:
        logits = torch.cat([torch.randn(before, VOCAB, generator=gen), fixed])
        spans = [PromptSpan("fixed", 1, before, targets, 4)]
        return score_spans(logits, spans, lambda flat, hidden: hidden)["fixed"].entries

    alone = score(0)
    assert set(interpreted_mode) == {"log_softmax", "top4"}, interpreted_mode
    assert score(5) == alone
    want = torch.sort(torch.log_softmax(fixed, -1), dim=-1, descending=True, stable=True).indices[:, :4]
    assert [list(entry)[:4] for entry in alone] == want.tolist()  # the top ids first, in order


def test_the_rejection_sampler_in_the_mode_takes_the_row_kernels(interpreted_mode):
    """Speculative decoding's verification in the mode: its greedy and sampled picks, logprobs and top ids
    through the same row kernels as the Sampler's, and a sequence's tokens and logprobs the same alone and
    beside another sequence with drafts."""
    from lora_runner.spec_decode.rejection_sampler import RejectionSampler

    gen = torch.Generator().manual_seed(17)
    sampler = Sampler(VOCAB, "cpu")
    fixed = torch.randint(-40, 40, (3, VOCAB), generator=gen).float() / 8  # its 2 drafts' positions + bonus
    drafts = [int(fixed[0].argmax()), 7]

    def verify(others: int) -> tuple:
        logits = torch.cat([fixed, torch.randint(-40, 40, (others, VOCAB), generator=gen).float() / 8])
        params = [FIXED] * 3 + [SamplingParams(temperature=0.0, logprobs=3)] * others
        generators = [torch.Generator().manual_seed(FIXED.seed)] * 3 + [None] * others
        output = RejectionSampler(sampler)(logits, sampler.make_batch(params, generators),
                                           [drafts] + ([[1] * (others - 1)] if others else []))
        return output.sampled_token_ids[0], output.sampled_logprobs[0]

    alone = verify(0)
    assert set(interpreted_mode) == {"cumsum", "top1", "top5", "softmax", "log_softmax"}, interpreted_mode
    assert verify(4) == alone


def test_moe_routing_in_the_mode_takes_the_row_kernels_and_the_invariant_gemm(interpreted_mode, tmp_path):
    """A Qwen3-MoE block in the mode: a token's routed-expert output is the same bits alone and among 1..40
    random tokens (its experts' groups then hold other tokens), each expert's GEMMs were the fixed-config
    GEMM (cuBLAS would pick its algorithm by the group's M), the router's top-k takes the lowest expert on
    ties, and the output is the default path's within fp32 rounding."""
    from test_moe import save_moe

    from lora_runner.model import load_model
    from lora_runner.model.moe import SparseMoeBlock

    save_moe(tmp_path, "qwen3_moe", seed=4)
    model = load_model(str(tmp_path))[0]
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    gen = torch.Generator().manual_seed(14)
    token = torch.randn(64, generator=gen)

    def routed(hidden: torch.Tensor) -> torch.Tensor:
        return block.routed_experts(hidden, *block.route(hidden, None), None)

    alone = routed(token[None])[0]
    assert interpreted_mode["matmul"] == 2 * block.top_k  # gate_up and down of each of the token's experts
    for size in (1, 5, 16, 40):
        hidden, position = _among(gen, token, torch.randn(size, 64, generator=gen))
        assert torch.equal(routed(hidden)[position], alone), size
    with invariant.active(False):
        torch.testing.assert_close(routed(token[None])[0], alone, rtol=1e-5, atol=1e-5)
    hidden = torch.randn(3, 64, generator=gen)
    block.router.packed_weight = None  # all logits equal: every expert ties
    block.router.weight = torch.nn.Parameter(torch.zeros(sum(block.router.slice_sizes), 64), requires_grad=False)
    assert block.route(hidden, None)[1].tolist() == [list(range(block.top_k))] * 3


@pytest.mark.gpu
def test_cuda_top_p_sampling_is_bitwise_invariant():
    """On a lent GPU, in the mode: a seeded top-k/top-p row with logprobs, bf16-valued logits (ties) over a
    150k vocabulary (torch's cumsum of one row is cub's device scan, of several one block each; its topk
    changes algorithm with the number of rows): the same token and logprob bits alone and among 1..64
    random rows."""
    vocab, gen = 151936, torch.Generator(device="cuda").manual_seed(15)
    sampler = Sampler(vocab, "cuda")
    row = (torch.randn(vocab, generator=gen, device="cuda") * 3).bfloat16().float()
    with invariant.active():
        alone = _sample_fixed(sampler, row[None], [FIXED], 0)
        for size in (1, 2, 7, 11, 33, 64):
            others = (torch.randn(size, vocab, generator=gen, device="cuda") * 3).bfloat16().float()
            logits, position = _among(torch.Generator().manual_seed(size), row, others)
            params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(size)]
            params.insert(position, FIXED)
            assert _sample_fixed(sampler, logits, params, position) == alone, size
