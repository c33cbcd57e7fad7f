"""A LoRA-capable layer kind added to a model reaches the adapter code without touching ``adapters/``.

The layer kind (:class:`ToyProjection`) and the model (:class:`ToyModel`) live in this file only: the
kind declares its LoRA modules (adapters.spec.LoRAModule: its PEFT names, slice sizes and
tensor-parallel split), the model's ModelSpec is collected from its modules, and an adapter PEFT wrote
for the equivalent torch model (separate ``in_a`` / ``in_b`` / ``out`` linears) is validated, written to
slots, sharded over two ranks and computed through punica_kernels.add_lora, equal to PEFT's forward;
DoRA's norms come from the same base-weight reader the decoder uses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import punica_kernels
from adapters import ModelSpec
from adapters.lora import load_lora
from adapters.sharding import shard_lora_weights, shard_spec
from adapters.slots import LoRASlots
from adapters.spec import COLUMN, ROW, LoRAModule, Split
from factories import save_lora
from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.lora_linear import base_weight_reader, collect_spec

HIDDEN, INNER, LAYERS, MAX_LORAS, MAX_RANK = 12, 8, 2, 3, 8


class ToyProjection(nn.Module):
    """The new kind: y = x @ W.T plus each token's LoRA delta, built at one rank's share of its module."""

    def __init__(self, lora_module: LoRAModule, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.lora_module, self.rank, self.world_size = lora_module, rank, world_size
        local = lora_module.shard(rank, world_size)
        self.weight = nn.Parameter(torch.zeros(local.out_features, local.in_features), requires_grad=False)
        self.slice_sizes = local.slice_sizes

    def load_whole(self, weight: torch.Tensor) -> None:
        """Copy this rank's part of the whole weight [N, K] (the rows / columns its split gives it)."""
        rows = [weight[offset + r0:offset + r1] for offset, (r0, r1) in
                zip(self.lora_module.slice_offsets, self.lora_module.slice_rows(self.rank, self.world_size))]
        c0, c1 = self.lora_module.input_columns(self.rank, self.world_size)
        self.weight.copy_(torch.cat(rows)[:, c0:c1])

    def base_weight(self) -> torch.Tensor:
        return self.weight

    def forward(self, x: torch.Tensor, lora: LoRAContext | None) -> torch.Tensor:
        y = x @ self.weight.T  # [T, N]
        if lora is not None:
            key = self.lora_module.key
            slice_scales, column_scales = lora.slots.scales(*key)
            punica_kernels.add_lora(y, x, *lora.slots.weights(*key), lora.meta, self.slice_sizes,
                                    slice_scales=slice_scales, column_scales=column_scales, backend="torch")
        return y  # a row-parallel rank's partial sum


def toy_modules(layer: int) -> tuple[LoRAModule, LoRAModule]:
    """(mix, out) of one toy block: in_a,in_b packed column-parallel; out row-parallel."""
    rows = Split(INNER, 1, "inner_size")
    mix = LoRAModule(layer, "mix", HIDDEN, (INNER, INNER),
                     ((f"blocks.{layer}.in_a", (0,)), (f"blocks.{layer}.in_b", (1,))), COLUMN, out_splits=(rows, rows))
    out = LoRAModule(layer, "out", INNER, (HIDDEN,), ((f"blocks.{layer}.out", (0,)),), ROW, in_split=rows)
    return mix, out


class ToyModel(nn.Module):
    """h + out(tanh(in_a(h)) * in_b(h)) per block, over one rank's share (partial sums at world_size > 1)."""

    def __init__(self, rank: int = 0, world_size: int = 1):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({name: ToyProjection(module, rank, world_size) for name, module in
                                                   zip(("mix", "out"), toy_modules(layer))}) for layer in range(LAYERS))

    def block(self, layer: int, hidden: torch.Tensor, lora: LoRAContext | None) -> torch.Tensor:
        a, b = self.blocks[layer]["mix"](hidden, lora).chunk(2, dim=-1)
        return self.blocks[layer]["out"](torch.tanh(a) * b, lora)


class Reference(nn.Module):
    """The same model as PEFT sees it: one nn.Linear per PEFT module."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(nn.ModuleDict({name: nn.Linear(k, n, bias=False) for name, k, n in (
            ("in_a", HIDDEN, INNER), ("in_b", HIDDEN, INNER), ("out", INNER, HIDDEN))}) for _ in range(LAYERS))
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.4)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = hidden + block["out"](torch.tanh(block["in_a"](hidden)) * block["in_b"](hidden))
        return hidden


def toy_shard(reference: Reference, rank: int, world_size: int) -> ToyModel:
    model = ToyModel(rank, world_size)
    with torch.no_grad():
        for block, ref in zip(model.blocks, reference.blocks):
            block["mix"].load_whole(torch.cat([ref["in_a"].weight, ref["in_b"].weight]))
            block["out"].load_whole(ref["out"].weight)
    return model


def run(models: list[ToyModel], slots: list[LoRASlots], hidden: torch.Tensor, token_slots: list[int]) -> torch.Tensor:
    """The toy forward over every rank's shard: each block's partial outputs summed (the all-reduce)."""
    meta = punica_kernels.LoRAMeta(hidden.shape[0], MAX_LORAS, "cpu")
    punica_kernels.load_table(meta, torch.tensor(token_slots))
    contexts = [LoRAContext(meta, rank_slots) for rank_slots in slots]
    for layer in range(LAYERS):
        hidden = hidden + sum(model.block(layer, hidden, lora) for model, lora in zip(models, contexts))
    return hidden


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """(reference model, ModelSpec collected from the toy model, {name: (adapter dir, PeftModel)})."""
    root = tmp_path_factory.mktemp("toy")
    reference = Reference().eval()
    spec = collect_spec(toy_shard(reference, 0, 1), ModelSpec(num_layers=LAYERS, hidden_size=HIDDEN))
    adapters = {
        "lora": save_lora(reference, root / "lora", seed=1, r=4, lora_alpha=8, target_modules=["in_a", "in_b", "out"],
                          rank_pattern={"in_b": 8}, use_rslora=True),
        "dora": save_lora(reference, root / "dora", seed=2, r=4, lora_alpha=8, target_modules=["in_b", "out"],
                          use_dora=True, scale=0.2),
    }
    return reference, spec, {name: (str(root / name), peft) for name, peft in adapters.items()}


def test_spec_is_collected_from_the_new_kind(toy):
    _, spec, _ = toy
    assert [m.key for m in spec.modules] == [(0, "mix"), (0, "out"), (1, "mix"), (1, "out")]
    assert spec.peft_targets()["blocks.1.in_b"] == (spec.modules[2], (1,))
    local = shard_spec(spec, 1, 2).modules
    assert [(m.in_features, m.slice_sizes) for m in local[:2]] == [(HIDDEN, (4, 4)), (4, (HIDDEN,))]


@pytest.mark.parametrize("world_size", [1, 2])
def test_adapters_on_the_new_kind_equal_peft(toy, world_size):
    """A plain LoRA (rsLoRA, a rank pattern) in slot 0 and a DoRA one in slot 2, next to base tokens:
    validated against the collected spec, each rank's shard in slots of its share, summed = PEFT."""
    reference, spec, adapters = toy
    whole = toy_shard(reference, 0, 1)
    linears = {m.lora_module.key: m for m in whole.modules() if isinstance(m, ToyProjection)}
    weights = {"lora": load_lora("lora", adapters["lora"][0], spec, max_lora_rank=MAX_RANK),
               "dora": load_lora("dora", adapters["dora"][0], spec, max_lora_rank=MAX_RANK,
                                 base_weight=base_weight_reader(lambda layer, name: linears[(layer, name)]))}
    assert weights["lora"].rank == 8 and weights["dora"].modules[(0, "mix")][0] is None  # in_a untargeted
    models = [toy_shard(reference, rank, world_size) for rank in range(world_size)]
    slots = [LoRASlots(shard_spec(spec, rank, world_size), MAX_LORAS, MAX_RANK) for rank in range(world_size)]
    for rank, rank_slots in enumerate(slots):
        for slot, name in ((0, "lora"), (2, "dora")):
            rank_slots.write(slot, shard_lora_weights(weights[name], spec, rank, world_size))
    hidden = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(world_size))
    token_slots = [0, -1, 2, 0, 2]
    got = run(models, slots, hidden, token_slots)
    oracles = {0: adapters["lora"][1], -1: reference, 2: adapters["dora"][1]}
    with torch.no_grad():
        expected = torch.cat([oracles[slot](hidden[t:t + 1]) for t, slot in enumerate(token_slots)])
        base = reference(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (expected - base)[[0, 2, 3, 4]].abs().amin(dim=1).min() > 1e-3  # every adapter token moved
