"""LoRA on Mixtral, Qwen3-MoE and Qwen2-MoE: per-expert module, router, shared-expert and attention LoRA, exact.

Per-expert adapters (``mlp.experts.<e>.gate_proj/up_proj/down_proj``, Mixtral's ``block_sparse_moe.
experts.<e>.w1/w3/w2``) are what tools trained against transformers 4's per-expert modules write;
transformers 5 holds the experts fused, so PEFT cannot write them over it: they are written here in
PEFT's file format, and the oracle is transformers with the merged weights (W_e + scaling * B_e A_e,
the router's and attention's likewise). The attention-only adapter is written by PEFT and its oracle
is PEFT's forward. One mixed batch holds the base model, an adapter on every expert (and q/v), one on
two experts only, a router adapter and the attention-only one, over prefill and decodes; an engine
with fewer slots than adapters serves them in mixed batches. PEFT's ``target_parameters`` LoRA on
the fused experts (written by PEFT) matches PEFT's forward. DoRA on an expert and target_parameters
naming a parameter that is not a stacked expert one (the router's) are refused naming it.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import save_file

import punica_kernels
from adapters import UnsupportedAdapterError
from adapters.lora import load_lora
from adapters.slots import LoRASlots
from factories import save_lora
from engine_support import assert_churn_exact, churn_adapters
from lora_runner import LLMEngine
from lora_runner.model import load_model
from lora_runner.model.forward_context import LoRAContext
from test_model_harness import PagedDriver, assert_close, hf_logits
from test_moe import save_moe

ATOL = 1e-4
EXPERT_LEAVES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# name -> (target_modules, r, lora_alpha); leaves of the other family are simply absent from a model
ADAPTERS = {
    "all-experts": (["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"], 4, 8),
    "two-experts": (r".*experts\.(0|2)\.(up_proj|down_proj|w3|w2)", 6, 12),
    "router": (["gate", "shared_expert_gate"], 2, 4),
}


def write_adapter(path, spec, target_modules, r: int, alpha: float, seed: int) -> dict[str, tuple]:
    """A PEFT-format LoRA on every module of ``spec`` the targets match (suffix list or full regex, as
    PEFT); random A, B. Returns {module path: (A, B)}."""
    import re

    gen = torch.Generator().manual_seed(seed)
    if isinstance(target_modules, str):
        matched = [p for p in spec.peft_targets() if re.fullmatch(target_modules, p)]
    else:
        matched = [p for p in spec.peft_targets() if p.rsplit(".", 1)[1] in target_modules]
    factors = {}
    for p in matched:
        module, indices = spec.peft_targets()[p]
        (shape_a, shape_b) = module.peft_shapes(indices, r)
        factors[p] = (torch.randn(shape_a, generator=gen) * 0.3, torch.randn(shape_b, generator=gen) * 0.3)
    path.mkdir(parents=True)
    tensors = {f"base_model.model.{p}.lora_{ab}.weight": t.contiguous()
               for p, (a, b) in factors.items() for ab, t in (("A", a), ("B", b))}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(dict(
        peft_type="LORA", r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
        task_type="CAUSAL_LM")))
    return factors


def merged_model(hf, factors: dict, scaling: float):
    """transformers ``hf`` with W + scaling * B @ A merged into each targeted weight (its fused experts'
    rows for a per-expert module, the router's weight for ``gate``)."""
    merged = copy.deepcopy(hf)
    for path, (a, b) in factors.items():
        delta = scaling * b @ a  # [out, in]
        parent, leaf = path.rsplit(".", 1)
        with torch.no_grad():
            if ".experts." in parent:
                layer_path, expert = parent.replace("block_sparse_moe", "mlp").rsplit(".experts.", 1)
                experts = merged.get_submodule(f"{layer_path}.experts")
                rows = delta.shape[0]
                target = {"gate": experts.gate_up_proj[int(expert), :rows], "up": experts.gate_up_proj[int(expert), rows:],
                          "down": experts.down_proj[int(expert)]}[EXPERT_LEAVES[leaf]]
            elif leaf == "gate":
                target = merged.get_submodule(path.replace("block_sparse_moe", "mlp")).weight
            else:
                target = merged.get_submodule(path).weight
            target.add_(delta)
    return merged.eval()


def family_adapters(root, hf, spec, seed: int = 0) -> dict[str, tuple[str, torch.nn.Module]]:
    """{name: (adapter dir, its oracle)}: ADAPTERS (merged-weights oracles) and a PEFT attention-only one."""
    adapters = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        factors = write_adapter(root / name, spec, targets, r, alpha, seed + i)
        assert factors, name
        adapters[name] = (str(root / name), merged_model(hf, factors, alpha / r))
    adapters["attention-only"] = (str(root / "attention-only"),
                                  save_lora(hf, root / "attention-only", seed=seed, r=4, target_modules=("q_proj", "o_proj")))
    return adapters


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_mixed_batch_matches_merged_and_peft_oracles(family, tmp_path):
    hf = save_moe(tmp_path / "model", family, seed=21)
    model, config, _ = load_model(str(tmp_path / "model"))
    spec = config.spec()
    adapters = family_adapters(tmp_path, hf, spec)
    slots, slot_of = LoRASlots(spec, 5, 8), {}
    for slot, name in zip((3, 0, 4, 1), adapters):
        slots.write(slot, load_lora(name, adapters[name][0], spec, max_lora_rank=8))
        slot_of[name] = slot
    seq_adapter = dict(enumerate([None, *adapters]))
    gen = torch.Generator().manual_seed(0)
    full = {s: torch.randint(3, 256, (9,), generator=gen) for s in seq_adapter}
    expected = {s: hf_logits(adapters[a][1] if a else hf, full[s]) for s, a in seq_adapter.items()}
    base = {s: hf_logits(hf, full[s]) for s in seq_adapter}
    for s, name in seq_adapter.items():  # each adapter moves the logits: a dropped delta would show
        assert name is None or (expected[s] - base[s]).abs().max() > 1e-2, name
    meta, driver = punica_kernels.LoRAMeta(64, 5, "cpu"), PagedDriver(model, config, block_size=4, seed=1)
    for start, end in ((0, 6), (6, 7), (7, 9)):
        chunks = [(s, full[s][start:end]) for s in seq_adapter]
        punica_kernels.load_table(meta, torch.tensor([slot_of.get(seq_adapter[s], -1) for s, t in chunks for _ in t]))
        for (s, _), got in zip(chunks, driver.step(chunks, lora=LoRAContext(meta, slots))):
            assert_close(got, expected[s][start:end], f"tokens {start}..{end}, {seq_adapter[s] or 'base'}")


def test_engine_serves_expert_adapters_over_fewer_slots(tmp_path, greedy_oracle):
    hf = save_moe(tmp_path / "model", "qwen3_moe", seed=22)
    adapters = family_adapters(tmp_path, hf, load_model(str(tmp_path / "model"))[1].spec(), seed=3)
    engine = LLMEngine(str(tmp_path / "model"), dtype="float32", max_num_seqs=4, max_model_len=40, max_loras=2,
                       max_lora_rank=8, max_cpu_loras=2, block_size=4, max_num_batched_tokens=16)
    requests, done = churn_adapters(engine, adapters, max_prompt=12)  # 4 adapters over 2 slots, and the base
    assert_churn_exact(requests, done, lambda name: adapters[name][1] if name else hf, greedy_oracle, ATOL)


def test_dora_on_an_expert_and_other_target_parameters_are_refused(tmp_path):
    save_moe(tmp_path / "model", "mixtral", seed=23)
    spec = load_model(str(tmp_path / "model"))[1].spec()
    write_adapter(tmp_path / "dora", spec, ["w2"], 2, 4, seed=0)
    config_path = tmp_path / "dora" / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"use_dora": True}))
    with pytest.raises(UnsupportedAdapterError, match=r"DoRA on model\.layers\.0\.block_sparse_moe\.experts\.0\.w2"):
        load_lora("dora", str(tmp_path / "dora"), spec, max_lora_rank=8, base_weight=lambda layer, name: None)
    write_adapter(tmp_path / "router-param", spec, ["q_proj"], 2, 4, seed=0)
    config_path = tmp_path / "router-param" / "adapter_config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | {"target_parameters": ["mlp.gate.weight"]}))
    with pytest.raises(UnsupportedAdapterError, match=r"target_parameters 'mlp.gate.weight' names no stacked"):
        load_lora("router-param", str(tmp_path / "router-param"), spec, max_lora_rank=8)


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
def test_target_parameters_on_fused_experts_match_peft(family, tmp_path):
    """PEFT's target_parameters LoRA on transformers 5's fused experts (lora_A [E*r, in], lora_B
    [out, E*r], nested ParamWrapper keys) beside a per-expert adapter and the base model in one batch,
    vs PEFT's own forward."""
    hf = save_moe(tmp_path / "model", family, seed=24)
    model, config, _ = load_model(str(tmp_path / "model"))
    spec = config.spec()
    oracles = {"fused": save_lora(hf, tmp_path / "fused", seed=1, r=3, lora_alpha=6, target_modules=["q_proj"],
                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
               "per-expert": family_adapters(tmp_path, hf, spec)["all-experts"][1]}
    slots, slot_of = LoRASlots(spec, 2, 8), {"fused": 1, "per-expert": 0}
    slots.write(1, load_lora("fused", str(tmp_path / "fused"), spec, max_lora_rank=8))
    slots.write(0, load_lora("all-experts", str(tmp_path / "all-experts"), spec, max_lora_rank=8))
    assert_slots_match_oracles(model, config, hf, slots, slot_of, oracles, moved=("fused",))


def assert_slots_match_oracles(model, config, hf, slots, slot_of: dict, oracles: dict, moved: tuple,
                               atol: float | None = None) -> None:
    """Three sequences (the base model, then "fused" and "per-expert" on their slots) in one batch through
    the model's own forward, prefilled 6 tokens and decoded 2 in chunks, against each oracle's (transformers
    / PEFT) logits; each adapter of `moved` is first shown to move the logits (a dropped delta would show)."""
    seq_adapter = dict(enumerate([None, "fused", "per-expert"]))
    gen = torch.Generator().manual_seed(4)
    full = {s: torch.randint(3, 256, (8,), generator=gen) for s in seq_adapter}
    expected = {s: hf_logits(oracles[a] if a else hf, full[s]) for s, a in seq_adapter.items()}
    for s, adapter in seq_adapter.items():
        if adapter in moved:
            assert (expected[s] - hf_logits(hf, full[s])).abs().max() > 1e-2, adapter
    meta, driver = punica_kernels.LoRAMeta(64, 2, "cpu"), PagedDriver(model, config, block_size=4, seed=1)
    tolerance = {} if atol is None else {"atol": atol}
    for start, end in ((0, 6), (6, 7), (7, 8)):
        chunks = [(s, full[s][start:end]) for s in seq_adapter]
        punica_kernels.load_table(meta, torch.tensor([slot_of.get(seq_adapter[s], -1) for s, t in chunks for _ in t]))
        for (s, _), got in zip(chunks, driver.step(chunks, lora=LoRAContext(meta, slots))):
            assert_close(got, expected[s][start:end], f"tokens {start}..{end}, {seq_adapter[s] or 'base'}",
                         **tolerance)
