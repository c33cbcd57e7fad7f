"""DoRA (use_dora=True) served unmerged, against PEFT-written adapters and PEFT's forward.

PEFT refuses mixed-adapter batches with DoRA, so the oracle is each adapter's own PeftModel. The base
is a Qwen2 with random q/k/v biases: DoRA scales the output of a module but not its bias.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from adapters import InvalidAdapterError, LoRARequest, UnsupportedAdapterError
from adapters.lora import load_lora
from adapters.slots import LoRASlots
from factories import (build_tiny_model, edit_adapter_config, edit_adapter_tensors, model_spec, save_lora,
                       save_tiny_tokenizer)
from lora_runner import SamplingParams
from lora_runner.model.layers import lora_base_weights
from lora_runner.model.loader import load_model
from punica_kernels import LoRAMeta, add_lora, load_table
from engine_support import assert_exact, make_engine, run_to_completion
from test_model_harness import randomize_biases

DORA_ADAPTERS = {  # name -> save_lora kwargs
    "dora-r8": dict(seed=11, r=8, lora_alpha=16),
    "dora-patterns": dict(seed=12, r=4, lora_alpha=8, use_rslora=True, rank_pattern={"v_proj": 8},
                          alpha_pattern={"k_proj": 32}, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")),
}
PLAIN = dict(seed=13, r=8, lora_alpha=16)


def save_dora(base, path, seed: int, **kwargs):
    """A DoRA adapter written by PEFT, with magnitudes PEFT-like (the merged weight's row norms times
    1 + noise) instead of the factory's noise; returns the PeftModel."""
    peft_model = save_lora(base, path, seed=seed, scale=0.15, use_dora=True, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in peft_model.modules():
            if getattr(module, "lora_magnitude_vector", None) and "default" in module.lora_magnitude_vector:
                delta = module.lora_B["default"].weight @ module.lora_A["default"].weight
                norm = (module.base_layer.weight + module.scaling["default"] * delta).norm(dim=1)
                noise = 1 + 0.3 * torch.randn(norm.shape, generator=gen)
                module.lora_magnitude_vector["default"].weight.copy_(norm * noise)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model dir, transformers model, {name: (adapter dir, PeftModel)}): a tiny Qwen2 with biases."""
    root = tmp_path_factory.mktemp("dora")
    hf = build_tiny_model("qwen2", seed=3)
    randomize_biases(hf, seed=3)
    hf.save_pretrained(str(root / "model"))
    save_tiny_tokenizer(root / "model", hf.config.vocab_size)
    adapters = {name: (str(root / name), save_dora(hf, root / name, **kwargs))
                for name, kwargs in DORA_ADAPTERS.items()}
    adapters["plain"] = (str(root / "plain"), save_lora(hf, root / "plain", scale=0.15, **PLAIN))
    return str(root / "model"), hf.eval(), adapters


def _module(model, path: str):
    """A projection of a transformers model, or of a PeftModel (its LoRA/DoRA-wrapped module), by its
    PEFT module path (a LoRAModule's peft_modules)."""
    root = model.base_model.model if hasattr(model, "peft_config") else model
    return root.get_submodule(path)


def test_dora_modules_equal_peft_through_slots_and_kernels(checkpoint):
    """Every packed module of a DoRA adapter (q/k/v slices each with their own scale, rsLoRA and
    patterns, biased q/k/v) as the engine computes it: base linear + add_lora with the slot's scales,
    for a token of the DoRA slot, one of a plain slot and one with no adapter."""
    path, hf, adapters = checkpoint
    model, config, _ = load_model(path)
    spec = config.spec()
    slots = LoRASlots(spec, max_loras=3, max_lora_rank=8)
    dora = load_lora("d", adapters["dora-patterns"][0], spec, max_lora_rank=8, base_weight=lora_base_weights(model))
    slots.write(2, load_lora("d0", adapters["dora-r8"][0], spec, max_lora_rank=8,
                             base_weight=lora_base_weights(model)))
    slots.write(2, dora)  # over another DoRA tenant
    slots.write(0, load_lora("p", adapters["plain"][0], spec, max_lora_rank=8))
    meta = LoRAMeta(3, 3, "cpu")
    load_table(meta, torch.tensor([2, 0, -1]))
    linears = {m.lora_module.key: m for m in model.modules() if hasattr(m, "lora_module")}
    oracles = (adapters["dora-patterns"][1], adapters["plain"][1], hf)
    assert len(linears) == len(spec.modules) == 4 * spec.num_layers
    for key, linear in linears.items():
        x = torch.randn(3, linear.in_features)
        y = linear.method.apply(linear, x, linear.bias)  # the base GEMM the engine runs
        add_lora(y, x, *slots.weights(*key), meta, linear.slice_sizes, backend="torch",
                 **dict(zip(("slice_scales", "column_scales"), slots.scales(*key))), bias=linear.bias)
        paths = [path for path, _ in linear.lora_module.peft_modules]
        with torch.no_grad():
            expected = torch.cat([torch.cat([_module(oracle, path)(x[t:t + 1]) for path in paths], dim=1)
                                  for t, oracle in enumerate(oracles)])  # [3, N]
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5, msg=str(key))
    scales = slots.scales(0, "qkv")[1][2]  # [N]: the DoRA slot's q, k, v column scales all differ from 1
    assert all((part - 1).abs().min() > 0 for part in scales.split(spec.slice_sizes("qkv")))


GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)


def check(done, requests, models, greedy_oracle):
    for request_id, prompt, _, lora in requests:
        assert_exact(done[request_id], models[lora.name if lora else None], prompt, greedy_oracle, 5)


def column_scales_of(engine, name: str) -> list[torch.Tensor]:
    slot = engine.adapters.manager.loras._serving(name).slot  # noqa: SLF001 (the test reads the slot it got)
    slots = engine.adapters.manager.lora_slots
    return [slots.scales(*module.key)[1][slot] for module in slots.spec.modules]


def test_mixed_dora_lora_and_base_batch_matches_peft_then_slot_reuse(checkpoint, greedy_oracle):
    path, hf, adapters = checkpoint
    models = {None: hf, **{name: model for name, (_, model) in adapters.items()}}
    request = {name: LoRARequest(name, adapter_dir) for name, (adapter_dir, _) in adapters.items()}
    engine = make_engine(path, max_lora_rank=8, max_cpu_loras=3)
    # one batch: two DoRA adapters (both slots) and requests without an adapter
    first = [("d1", [5, 6, 7, 8], GREEDY, request["dora-r8"]), ("base1", [9, 10], GREEDY, None),
             ("d2", [11, 12, 13], GREEDY, request["dora-patterns"]), ("base2", [14], GREEDY, None)]
    check(run_to_completion(engine, first), first, models, greedy_oracle)
    assert any((scales != 1).any() for scales in column_scales_of(engine, "dora-r8"))
    # plain LoRA now takes a slot a DoRA adapter held, next to the other DoRA adapter
    second = [("p1", [5, 6, 7, 8], GREEDY, request["plain"]), ("d3", [9, 10], GREEDY, request["dora-r8"]),
              ("base3", [3, 4], GREEDY, None)]
    check(run_to_completion(engine, second), second, models, greedy_oracle)
    assert all((scales == 1).all() for scales in column_scales_of(engine, "plain"))
    differs = [greedy_oracle(models[name], [5, 6, 7, 8], 5)[0] != greedy_oracle(hf, [5, 6, 7, 8], 5)[0]
               for name in ("dora-r8", "plain")]
    assert all(differs)  # the adapters matter
    # removing a resident DoRA adapter frees its scale row
    slot = engine.adapters.manager.loras._serving("dora-r8").slot  # noqa: SLF001
    engine.remove_lora("dora-r8")
    slots = engine.adapters.manager.lora_slots
    assert all((slots.scales(*module.key)[1][slot] == 1).all() for module in slots.spec.modules)


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def llama():
    return build_tiny_model("llama", seed=5)


def _base_weight(hf):
    """(layer, name) -> packed base weight of a transformers Llama (q,k,v and gate,up concatenated)."""
    modules = {module.key: module for module in model_spec(hf).modules}

    def weight(layer, name):
        return torch.cat([_module(hf, path).weight for path, _ in modules[(layer, name)].peft_modules])
    return weight


def test_dora_needs_the_base_weights_and_supported_modules(llama, tmp_path):
    spec = model_spec(llama)
    save_dora(copy.deepcopy(llama), tmp_path / "a", seed=1, r=4)
    with pytest.raises(UnsupportedAdapterError, match="'t'.*needs the base model's weights"):
        load_lora("t", str(tmp_path / "a"), spec, max_lora_rank=8)
    assert load_lora("t", str(tmp_path / "a"), spec, max_lora_rank=8, base_weight=_base_weight(llama)).rank == 4
    save_lora(llama, tmp_path / "b", r=4, use_dora=True, target_modules=["lm_head", "q_proj"])
    with pytest.raises(UnsupportedAdapterError, match="lm_head"):
        load_lora("t", str(tmp_path / "b"), spec, max_lora_rank=8, base_weight=_base_weight(llama))


def _drop_magnitude(tensors):
    return {k: v for k, v in tensors.items() if not (k.endswith("lora_magnitude_vector") and "layers.1.mlp.up" in k)}


def _edit_magnitude(value):
    def edit(tensors):
        key = next(k for k in tensors if k.endswith("layers.0.self_attn.k_proj.lora_magnitude_vector"))
        return {**tensors, key: value(tensors[key])}
    return edit


BAD_DORA = {  # name -> (tensor edit or None, config edits, message fragment)
    "magnitude missing": (_drop_magnitude, {}, "lora_magnitude_vector is missing"),
    "magnitude shape": (_edit_magnitude(lambda m: m[:-1]), {}, "shape"),
    "magnitude NaN": (_edit_magnitude(lambda m: m * float("nan")), {}, "NaN"),
    "magnitude without use_dora": (None, dict(use_dora=False), "does not set use_dora"),
    "use_dora not a bool": (None, dict(use_dora="yes"), "use_dora must be"),
}


@pytest.mark.parametrize("case", sorted(BAD_DORA))
def test_malformed_dora_is_invalid(llama, tmp_path, case):
    edit, config, fragment = BAD_DORA[case]
    save_dora(copy.deepcopy(llama), tmp_path, seed=2, r=4)
    if edit:
        edit_adapter_tensors(tmp_path, edit)
    if config:
        edit_adapter_config(tmp_path, **config)
    with pytest.raises(InvalidAdapterError, match=fragment):
        load_lora("t", str(tmp_path), model_spec(llama), max_lora_rank=8, base_weight=_base_weight(llama))


def test_column_scale_in_row_chunks_equals_the_formula(monkeypatch):
    """m / ||W + s * B @ A|| per row, the merged weight built a few rows at a time."""
    import adapters.dora as dora

    gen = torch.Generator().manual_seed(0)
    weight, lora_a, lora_b = (torch.randn(*shape, generator=gen) for shape in ((37, 50), (4, 50), (37, 4)))
    magnitude = torch.rand(37, generator=gen) + 0.5
    monkeypatch.setattr(dora, "CPU_CHUNK_ELEMENTS", 3 * 50 + 7)  # 3 rows a chunk, the last one short
    got = dora.dora_column_scale(weight, lora_a, lora_b.half(), 0.7, magnitude)
    merged = weight.double() + 0.7 * lora_b.half().double() @ lora_a.double()
    torch.testing.assert_close(got.double(), magnitude.double() / merged.norm(dim=1), rtol=1e-6, atol=0)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
