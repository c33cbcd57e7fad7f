"""The experts' weights and LoRA slots are laid out stacked from the start, and slots without expert LoRA
skip the expert LoRA ops.

* After loading (per-expert and fused checkpoint layouts, one rank and a rank of two), each MoE layer's
  experts' gate_up / down weights are evenly spaced entries of one storage (data_ptr arithmetic), with
  the checkpoint's values; so are the expert modules' LoRA slots (lora_a, lora_b, slice_scales), which
  have no DoRA column scales.
* The first fused forward (forced on the CPU: the Triton interpreter) copies nothing: every expert's
  weight and slot keeps its address and the kernels' stacks are views at them; its output equals the
  torch loop's.
* A slot whose adapter has no expert LoRA (attention only) sends no row to the expert LoRA ops, in the
  torch path (rows reaching moe_cpu.add_grouped_lora) and in the fused kernels (pairs in LoRA blocks of the
  alignment); the output is bit-identical to running them over its zero expert slots.
"""

from __future__ import annotations

import pytest
import torch

import punica_kernels
from adapters.lora import LoRAWeights, dummy_lora
from adapters.sharding import shard_spec
from adapters.slots import LoRASlots
from lora_runner.distributed import TensorParallel
from lora_runner.model import load_model, moe_cpu, moe_fused
from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.moe import SparseMoeBlock
from test_moe import save_moe

PROJECTIONS = ("gate_up", "down")


def assert_entries_of_one_buffer(tensors: list[torch.Tensor]) -> None:
    """The tensors are consecutive entries of one buffer: one storage, equal shapes and strides, each
    starting one entry's bytes after the previous one."""
    first = tensors[0]
    entry_bytes = first.numel() * first.element_size()
    for e, tensor in enumerate(tensors):
        assert tensor.untyped_storage().data_ptr() == first.untyped_storage().data_ptr(), e
        assert tensor.shape == first.shape and tensor.stride() == first.stride(), e
        assert tensor.data_ptr() == first.data_ptr() + e * entry_bytes, e
    assert first.untyped_storage().nbytes() >= len(tensors) * entry_bytes


def moe_blocks(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def expert_slot_tensors(slots: LoRASlots, layer: int, num_experts: int, projection: str) -> list[list[torch.Tensor]]:
    """[lora_a of every expert, lora_b of every expert, slice_scales of every expert] of one projection."""
    keys = [(layer, f"experts.{e}.{projection}") for e in range(num_experts)]
    return [[slots.weights(*key)[0] for key in keys], [slots.weights(*key)[1] for key in keys],
            [slots.scales(*key)[0] for key in keys]]


@pytest.mark.parametrize("family,fused", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False)],
                         ids=["qwen3_moe", "qwen3_moe-fused", "qwen2_moe"])
@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)], ids=["tp1", "rank1of2"])
def test_loaded_experts_and_their_slots_are_entries_of_one_buffer(family, fused, rank, world_size, tmp_path):
    hf = save_moe(tmp_path / "model", family, seed=3, fused=fused)
    # float16: a float32 CPU weight is repacked for oneDNN after loading (the torch loop's), dropping the stack
    model, config, _ = load_model(str(tmp_path / "model"), dtype=torch.float16, tp=TensorParallel(rank, world_size))
    slots = LoRASlots(shard_spec(config.spec(), rank, world_size), 3, 8, dtype=torch.float16)
    blocks = moe_blocks(model)
    assert blocks
    for block in blocks:
        layer = block.router.layer
        experts = hf.model.layers[layer].mlp.experts  # transformers 5's stacked [E, 2I, H] and [E, H, I]
        for projection in PROJECTIONS:
            weights = [getattr(expert, projection).weight for expert in block.experts]
            assert_entries_of_one_buffer(weights)
            if world_size == 1:  # the checkpoint's values (a rank's shard: tests/test_moe_tp.py)
                stacked = torch.stack([w.detach() for w in weights])
                assert torch.equal(stacked, getattr(experts, f"{projection}_proj").detach().half())
            for tensors in expert_slot_tensors(slots, layer, len(block.experts), projection):
                assert_entries_of_one_buffer(tensors)
            key = (layer, f"experts.0.{projection}")
            assert slots.scales(*key)[1] is None  # experts apply plain LoRA only: no DoRA column scales
        assert slots.scales(layer, "router")[1] is not None


def _dummy_adapters(spec) -> dict[int, LoRAWeights]:
    """Adapters on every module, of ranks 8, 16 and 4, in slots 0, 1, 2."""
    return {slot: dummy_lora(f"d{slot}", spec, rank, torch.float16, scale=0.2, seed=slot)
            for slot, rank in enumerate((8, 16, 4))}


def _loaded_block_and_lora(tmp_path, token_slots: list[int], adapters_of=_dummy_adapters):
    """(block of layer 0, LoRA context, hidden [T, H]) of a float16 Qwen3-MoE, slot -> adapter from
    ``adapters_of(spec)``."""
    save_moe(tmp_path / "model", "qwen3_moe", seed=4)
    model, config, _ = load_model(str(tmp_path / "model"), dtype=torch.float16)
    slots = LoRASlots(config.spec(), 3, 16, dtype=torch.float16)
    for slot, weights in adapters_of(config.spec()).items():
        slots.write(slot, weights)
    meta = punica_kernels.LoRAMeta(len(token_slots), 3, "cpu")
    punica_kernels.load_table(meta, torch.tensor(token_slots))
    gen = torch.Generator().manual_seed(9)
    hidden = torch.randn(len(token_slots), config.hidden_size, generator=gen).half()
    return moe_blocks(model)[0], LoRAContext(meta, slots), hidden


def test_first_fused_forward_copies_nothing_and_equals_the_torch_loop(tmp_path):
    pytest.importorskip("triton")
    block, lora, hidden = _loaded_block_and_lora(tmp_path, [0, 1, -1, 2, 1, 0, -1, 2, 2])
    layer, count = block.router.layer, len(block.experts)
    tensors = [getattr(e, p).weight for p in PROJECTIONS for e in block.experts]
    tensors += [t for p in PROJECTIONS for group in expert_slot_tensors(lora.slots, layer, count, p) for t in group]
    addresses = [t.data_ptr() for t in tensors]
    weights, experts = block.route(hidden, lora)
    expected = block.routed_experts(hidden, weights, experts, lora)  # the CPU's torch loop
    got = moe_fused.fused_routed_experts(block, hidden, weights, experts, lora)
    assert [t.data_ptr() for t in tensors] == addresses  # nothing moved: no copy was made
    stacks, base = moe_fused._STACKS[block], moe_fused.base_stacks(block)
    assert [base[p][0].data_ptr() for p in PROJECTIONS] == [block.experts[0].gate_up.weight.data_ptr(),
                                                            block.experts[0].down.weight.data_ptr()]
    for projection, stacked in zip(PROJECTIONS, stacks["lora"]):  # lora_a, lora_b, slice_scales [L, E, ...]
        firsts = [group[0] for group in expert_slot_tensors(lora.slots, layer, count, projection)]
        assert [s.data_ptr() for s in stacked] == [t.data_ptr() for t in firsts]
    torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert (got - block.routed_experts(hidden, weights, experts, None)).abs().max() > 1e-2  # the LoRA shows


def _attention_and_expert_adapters(spec) -> dict[int, LoRAWeights]:
    """Slot 0: an adapter on attention only (its expert slots stay zero); slot 1: one on every module."""
    everywhere = dummy_lora("experts", spec, 8, torch.float16, scale=0.2, seed=1)
    attention = dummy_lora("attention", spec, 8, torch.float16, scale=0.2, seed=2)
    attention = LoRAWeights("attention", 8, {key: pairs for key, pairs in attention.modules.items()
                                             if key[1] in ("qkv", "o")})
    return {0: attention, 1: everywhere}


@pytest.mark.parametrize("path", ["torch", "fused"])
def test_slots_without_expert_lora_send_no_row_to_the_expert_lora_ops(path, tmp_path, monkeypatch):
    token_slots = [0, 1, -1, 0, 0, 1, 0, -1]  # 4 tokens on the attention-only adapter, 2 on the expert one
    block, lora, hidden = _loaded_block_and_lora(tmp_path, token_slots, _attention_and_expert_adapters)
    assert lora.slots.expert_ranks.tolist() == [0, 8, 0] and lora.slots.slot_ranks.tolist() == [8, 8, 0]
    rows = []
    if path == "torch":
        add = moe_cpu.add_grouped_lora
        monkeypatch.setattr(moe_cpu, "add_grouped_lora", lambda y, x, groups, *args: rows.append(len(groups.groups))
                            or add(y, x, groups, *args))
        run = block.routed_experts
    else:
        pytest.importorskip("triton")
        from punica_kernels import moe_triton

        shrink = moe_triton.moe_lora_shrink

        def counting_shrink(x, lora_a, slot_ranks, align, top_k, out):
            pairs = align.sorted_pairs.view(-1, align.block_m)[align.block_slots >= 0]  # the LoRA blocks' rows
            rows.append(int((pairs < align.num_pairs).sum()))
            return shrink(x, lora_a, slot_ranks, align, top_k, out)

        monkeypatch.setattr(moe_triton, "moe_lora_shrink", counting_shrink)
        run = lambda *args: moe_fused.fused_routed_experts(block, *args)  # noqa: E731
    weights, experts = block.route(hidden, None)
    got = run(hidden, weights, experts, lora)
    top_k = experts.shape[1]
    if path == "fused":
        assert rows == [2 * top_k, 2 * top_k]  # gate_up, down: the pairs of the 2 tokens on the expert adapter
    else:
        assert sum(rows) == 2 * 2 * top_k  # each of the 2 tokens' k experts, gate_up and down
    skipped = sum(rows)
    # the same step as before the flag: every adapter's tokens through the expert LoRA (zeros for slot 0)
    rows.clear()
    lora.slots.expert_ranks.copy_(lora.slots.slot_ranks)
    assert torch.equal(run(hidden, weights, experts, lora), got)
    assert sum(rows) == skipped + 2 * 4 * top_k  # the attention-only adapter's 4 tokens now ran it too
