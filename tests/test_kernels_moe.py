"""Fused MoE kernels (punica_kernels.moe_triton) under the Triton interpreter, fp32 and fp16, against the
float64 loop of punica_kernels.moe_reference; the alignment's invariants; the block's fused path
(lora_runner.model.moe_fused) against its torch loop. (FP8 experts: tests/test_kernels_moe_fp8.py.)

Inputs drawn fresh per case; outputs and scratch NaN-poisoned before each call; routing from random
logits through transformers' top-k with and without renormalisation, skewed so that some experts
get no token; adapters of mixed ranks on some slots, tokens without one, empty slots.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("triton")

from punica_kernels import LoRAMeta, load_table  # noqa: E402
from punica_kernels.moe_align import max_blocks, moe_align  # noqa: E402
from punica_kernels.moe_reference import reference_moe, route  # noqa: E402
from punica_kernels.moe_triton import (fused_moe, moe_gemm, moe_lora_expand,  # noqa: E402
                                       moe_lora_shrink)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}
NAN = float("nan")
HIDDEN, INTERMEDIATE = 32, 24  # 24: the GEMMs' and the expand's column blocks are partial


def _routing(num_tokens: int, num_experts: int, top_k: int, renormalize: bool, gen: torch.Generator):
    """Random logits skewed towards the first experts, so that the last ones often get no token."""
    logits = torch.randn(num_tokens, num_experts, generator=gen) - torch.arange(num_experts) * 0.8
    return route(logits, top_k, renormalize)


def _factors(num_slots: int, num_experts: int, n_slices: int, out_features: int, in_features: int, rank: int,
             slot_ranks: torch.Tensor, gen: torch.Generator, dtype: torch.dtype) -> tuple:
    """(lora_a [L, E, n, R, K], lora_b [L, E, N, R], slice_scales [L, E, n]) as the slots hold them:
    zero beyond each slot's rank up to its rank rounded to 16, NaN beyond that (the kernels must not read it)."""
    lora_a = torch.randn(num_slots, num_experts, n_slices, rank, in_features, generator=gen) * in_features ** -0.5
    lora_b = torch.randn(num_slots, num_experts, out_features, rank, generator=gen) * 0.2
    for slot, slot_rank in enumerate(slot_ranks.tolist()):
        lora_a[slot, :, :, slot_rank:] = 0.0
        lora_b[slot, :, :, slot_rank:] = 0.0
        lora_a[slot, :, :, -(-slot_rank // 16) * 16:] = NAN
        lora_b[slot, :, :, -(-slot_rank // 16) * 16:] = NAN
    scales = torch.rand(num_slots, num_experts, n_slices, generator=gen) + 0.5
    return lora_a.to(dtype), lora_b.to(dtype), scales


def _case(num_tokens, num_experts, top_k, renormalize, dtype, seed, slots=None, slot_ranks=None, rank=32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    w_gate_up = (torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN ** -0.5).to(dtype)
    w_down = (torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE ** -0.5).to(dtype)
    weights, experts = _routing(num_tokens, num_experts, top_k, renormalize, gen)
    lora = None
    if slots is not None:
        num_slots = slot_ranks.shape[0]
        lora = (slots, slot_ranks,
                _factors(num_slots, num_experts, 2, 2 * INTERMEDIATE, HIDDEN, rank, slot_ranks, gen, dtype),
                _factors(num_slots, num_experts, 1, HIDDEN, INTERMEDIATE, rank, slot_ranks, gen, dtype))
    return x, w_gate_up, w_down, weights, experts, lora


@pytest.mark.parametrize("with_slots", [False, True])
@pytest.mark.parametrize("num_tokens,top_k,block_m", [(1, 1, 16), (13, 2, 16), (40, 3, 16), (40, 2, 64)])
def test_alignment_puts_every_pair_once_in_blocks_of_one_group(num_tokens, top_k, block_m, with_slots):
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    num_experts, num_slots = 6, 3
    _, experts = _routing(num_tokens, num_experts, top_k, True, gen)
    token_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen)
    pair_slots = token_slots.repeat_interleave(top_k) if with_slots else None
    align = moe_align(experts, num_experts, block_m, pair_slots, num_slots if with_slots else 0)
    num_pairs = num_tokens * top_k
    groups = num_experts * (num_slots + 1 if with_slots else 1)
    assert align.max_blocks == max_blocks(num_pairs, groups, block_m)  # routing-independent sizes
    pairs = align.sorted_pairs.view(-1, block_m).long()  # [max_blocks, block_m]
    real = pairs < num_pairs
    assert sorted(pairs[real].tolist()) == list(range(num_pairs))  # every pair exactly once
    flat_experts = experts.reshape(-1)
    hit = set(flat_experts.tolist())
    assert len(hit) < num_experts  # the skewed routing leaves some expert without a token
    for block, (expert, slot) in enumerate(zip(align.block_experts.tolist(), align.block_slots.tolist())):
        members = pairs[block][real[block]]
        if expert < 0:
            assert members.numel() == 0 and slot == -1
            continue
        assert members.numel() > 0 and expert in hit  # no block for an empty expert, none wholly padding
        assert (flat_experts[members] == expert).all()
        want = pair_slots[members] if with_slots else torch.full_like(members, -1)
        assert (want == slot).all()
    used = (align.block_experts >= 0).long()
    assert torch.equal(used, used.sort(descending=True).values)  # the unused blocks come last


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,num_experts,top_k,renormalize", [(1, 4, 1, False), (9, 8, 2, True),
                                                                      (21, 5, 3, False)])
def test_fused_moe_base_matches_float64(num_tokens, num_experts, top_k, renormalize, dtype):
    x, w_gate_up, w_down, weights, experts, _ = _case(num_tokens, num_experts, top_k, renormalize, dtype,
                                                      seed=num_tokens + top_k)
    got = fused_moe(x, w_gate_up, w_down, weights, experts)
    expected = reference_moe(x, w_gate_up, w_down, weights, experts, stored=dtype)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (17, 2), (12, 3)])
def test_fused_moe_with_expert_lora_of_mixed_ranks_matches_float64(num_tokens, top_k, dtype):
    """Slots of ranks 4, 16, 20 and an empty one (rank 0, its factors all NaN); tokens without an adapter;
    the factors beyond each rank rounded up to 16 are NaN (skipped, as the dense kernels)."""
    gen = torch.Generator().manual_seed(num_tokens * 3 + top_k)
    slot_ranks = torch.tensor([4, 16, 0, 20], dtype=torch.int32)
    token_slots = torch.tensor([0, 1, 3, -1])[torch.randint(0, 4, (num_tokens,), generator=gen)]
    token_slots[0] = 3 if num_tokens == 1 else token_slots[0]
    x, w_gate_up, w_down, weights, experts, lora = _case(num_tokens, 6, top_k, True, dtype, seed=num_tokens,
                                                         slots=token_slots, slot_ranks=slot_ranks)
    got = fused_moe(x, w_gate_up, w_down, weights, experts, lora)
    clean = (lora[0], lora[1], *(tuple(t.nan_to_num(0.0) for t in factors) for factors in lora[2:]))
    expected = reference_moe(x, w_gate_up, w_down, weights, experts, clean, stored=dtype)
    assert not torch.allclose(expected, reference_moe(x, w_gate_up, w_down, weights, experts), atol=1e-2)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ops_write_every_pair_and_leave_rows_without_an_adapter(dtype):
    """The GEMM writes every pair's row (NaN-poisoned before); the shrink writes only pairs with a slot,
    never reading A beyond the slot's rank rounded up to 16 (NaN there); the expand leaves the other rows
    bit-identical."""
    num_tokens, top_k = 11, 2
    slot_ranks = torch.tensor([8, 16], dtype=torch.int32)
    token_slots = torch.tensor([0, -1, 1, -1, 0, 1, 1, -1, 0, 0, -1])
    x, w_gate_up, _, weights, experts, lora = _case(num_tokens, 5, top_k, True, dtype, seed=5, slots=token_slots,
                                                    slot_ranks=slot_ranks, rank=32)
    pair_slots = token_slots.repeat_interleave(top_k)
    align = moe_align(experts, 5, 16, pair_slots, 2)
    out = torch.full((num_tokens * top_k, 2 * INTERMEDIATE), NAN, dtype=dtype)
    moe_gemm(x, w_gate_up, out, align, top_k)
    expected = torch.stack([x[p // top_k].double() @ w_gate_up[experts.reshape(-1)[p]].double().T
                            for p in range(num_tokens * top_k)])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)

    lora_a, lora_b, scales = lora[2]
    inter = torch.full((num_tokens * top_k, 2, 32), NAN)
    moe_lora_shrink(x, lora_a, slot_ranks, align, top_k, inter)
    with_slot = pair_slots >= 0
    assert inter[~with_slot].isnan().all() and not inter[with_slot].isnan().any()
    before = out.clone()
    moe_lora_expand(out, inter, lora_b, scales, slot_ranks, align)
    assert torch.equal(out[~with_slot], before[~with_slot])
    assert not torch.allclose(out[with_slot].double(), before[with_slot].double(), atol=1e-2)


def test_fused_moe_of_no_tokens_is_empty():
    slot_ranks = torch.tensor([8], dtype=torch.int32)
    case = _case(0, 4, 2, True, torch.float32, seed=0, slots=torch.zeros(0, dtype=torch.int64), slot_ranks=slot_ranks)
    assert fused_moe(*case[:5]).shape == (0, HIDDEN) and fused_moe(*case).shape == (0, HIDDEN)


# ---------------------------------------------------------------- the block's fused path (moe_fused)

def _block_and_lora(num_tokens: int, seed: int, device: str = "cpu", fp8: bool = False):
    """A Qwen3-MoE-shaped block with random weights (``fp8``: its experts quantized online, as
    quantization="fp8" loads them), and a LoRA context with random expert slots."""
    from adapters.slots import LoRASlots
    from lora_runner.model.config import ModelConfig
    from lora_runner.model.forward_context import LoRAContext
    from lora_runner.model.lora_linear import moe_lora_modules
    from lora_runner.model.moe import SparseMoeBlock
    from lora_runner.model.quant.config import parse_quantization

    config = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=32, hidden_size=HIDDEN, num_layers=1,
                         num_heads=2, num_kv_heads=2, head_dim=16, intermediate_size=64, rms_norm_eps=1e-6,
                         max_position_embeddings=64, num_experts=5, num_experts_per_tok=2,
                         moe_intermediate_size=INTERMEDIATE, norm_topk_prob=True, moe_layers=(0,),
                         moe_naming="qwen_moe", quantization=parse_quantization({}, "fp8" if fp8 else None))
    gen = torch.Generator().manual_seed(seed)
    block = SparseMoeBlock(config, 0, torch.float32, device)
    for param in block.parameters():
        param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    for linear in (linear for expert in block.experts for linear in (expert.gate_up, expert.down)) if fp8 else ():
        rows = torch.rand(linear.weight.shape[0], 1, generator=gen) + 0.2  # [N, 1]: rows of unlike magnitude
        weight = torch.randn(linear.weight.shape, generator=gen) * rows
        linear.method.load(linear, [("expert", {"weight": weight.to(device)}, weight.shape[0])])
    slots = LoRASlots(types.SimpleNamespace(modules=moe_lora_modules(config, 0)), 3, 16, device)
    slots.slot_ranks.copy_(torch.tensor([8, 0, 16], dtype=torch.int32))
    for expert in range(5):
        for projection in ("gate_up", "down"):
            lora_a, lora_b = slots.weights(0, f"experts.{expert}.{projection}")
            lora_a.copy_(torch.randn(lora_a.shape, generator=gen) * 0.3)
            lora_b.copy_(torch.randn(lora_b.shape, generator=gen) * 0.3)
            lora_a[0, :, 8:] = lora_b[0, :, 8:] = 0.0  # slot 0 holds a rank-8 adapter
            slots.scales(0, f"experts.{expert}.{projection}")[0].copy_(torch.rand(3, lora_a.shape[1], generator=gen))
    meta = LoRAMeta(num_tokens, 3, device)
    load_table(meta, torch.tensor([0, 2, -1, 2, 0, -1, 0])[torch.arange(num_tokens) % 7].to(device))
    return block, LoRAContext(meta, slots), gen


def test_block_fused_path_matches_its_torch_loop_and_follows_slot_writes():
    """The block's routed experts through moe_fused (stacked weights and slots) equal its CPU torch loop;
    a later in-place write into an expert's slot (as adapters.slots does) reaches the stacked views."""
    from lora_runner.model import moe_fused

    block, lora, gen = _block_and_lora(9, seed=1)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    weights, experts = block.route(hidden, None)
    for step in range(2):
        expected = block.routed_experts(hidden, weights, experts, lora)  # CPU: the torch loop
        got = moe_fused.fused_routed_experts(block, hidden, weights, experts, lora)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        lora_a, _ = lora.slots.weights(0, "experts.3.down")
        lora_a[2].mul_(-2.0)  # the next step's adapter differs: the stacks must see it
    torch.testing.assert_close(moe_fused.fused_routed_experts(block, hidden, weights, experts, None),
                               block.routed_experts(hidden, weights, experts, None), rtol=1e-5, atol=1e-5)


def test_stack_in_place_views_consecutive_tensors_and_rebinds_the_others():
    from lora_runner.model.moe_fused import stack_in_place

    buffer = torch.randn(3, 4, 5)
    view = stack_in_place(list(buffer))
    assert view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer)  # no copy
    tensors = [torch.randn(4, 5) for _ in range(3)]
    values = [t.clone() for t in tensors]
    stacked = stack_in_place(tensors)
    assert torch.equal(stacked, torch.stack(values))
    tensors[1][2, 3] = 7.0  # a write through an entry lands in the stack
    assert stacked[1, 2, 3] == 7.0
    assert stack_in_place(tensors).data_ptr() == stacked.data_ptr()  # now consecutive: a view


# ---------------------------------------------------------------- compiled, on a CUDA device (the device run)

def _to(value, device):
    """Tensors of a nested tuple moved to ``device``."""
    if isinstance(value, tuple):
        return tuple(_to(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [3, 300])  # the decode block size and the prefill one
def test_compiled_fused_moe_with_expert_lora_matches_float64(num_tokens, dtype):
    slot_ranks = torch.tensor([4, 16, 0, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(num_tokens)
    token_slots = torch.tensor([0, 1, 3, -1])[torch.randint(0, 4, (num_tokens,), generator=gen)]
    case = _case(num_tokens, 6, 2, True, dtype, seed=num_tokens, slots=token_slots, slot_ranks=slot_ranks)
    x, w_gate_up, w_down, weights, experts, lora = case
    got = fused_moe(*_to(case, "cuda"))
    clean = (lora[0], lora[1], *(tuple(t.nan_to_num(0.0) for t in factors) for factors in lora[2:]))
    expected = reference_moe(x, w_gate_up, w_down, weights, experts, clean, stored=dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=tol)


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph_for_any_routing_and_adapter_mix():
    """No host sync: captured once, replayed over new routing and token slots, equal to the eager call."""
    slot_ranks = torch.tensor([4, 16, 0, 20], dtype=torch.int32)
    case = _to(_case(16, 6, 2, True, torch.float16, seed=7, slots=torch.zeros(16, dtype=torch.int64),
                     slot_ranks=slot_ranks), "cuda")
    x, w_gate_up, w_down, weights, experts, lora = case
    fused_moe(*case)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(*case)
    gen = torch.Generator().manual_seed(8)
    for _ in range(3):
        new_weights, new_experts = _routing(16, 6, 2, True, gen)
        weights.copy_(new_weights)
        experts.copy_(new_experts)
        lora[0].copy_(torch.tensor([0, 1, 3, -1])[torch.randint(0, 4, (16,), generator=gen)])
        graph.replay()
        assert torch.equal(out, fused_moe(*case))


@pytest.mark.gpu
def test_block_on_cuda_takes_the_fused_kernels_and_matches_its_torch_loop(monkeypatch):
    from lora_runner.model import moe_fused

    block, lora, gen = _block_and_lora(9, seed=3, device="cuda")
    hidden = torch.randn(9, HIDDEN, generator=gen).cuda()
    weights, experts = block.route(hidden, None)
    calls, fused = [], moe_fused.fused_routed_experts
    monkeypatch.setattr(moe_fused, "fused_routed_experts", lambda *args: calls.append(1) or fused(*args))
    got = block.routed_experts(hidden, weights, experts, lora)
    assert calls == [1]
    monkeypatch.setattr(moe_fused, "fused_supported", lambda block: False)  # the torch loop, on the same tensors
    torch.testing.assert_close(got, block.routed_experts(hidden, weights, experts, lora), rtol=1e-4, atol=1e-4)
