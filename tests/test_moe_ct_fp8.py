"""Compressed-tensors FP8 checkpoints of Mixtral, Qwen3-MoE and Qwen2-MoE (as llm-compressor writes
Qwen3-30B-A3B-FP8-dynamic or a Mixtral FP8): every expert's gate, up and down an FP8 Linear of its own
(``experts.<e>.gate_proj.weight`` float8_e4m3fn + ``weight_scale``, per output channel or per tensor),
the router (and Qwen2-MoE's shared expert gate) left float through ``ignore``.

The checkpoints are made by compressed-tensors itself, from a tiny random MoE written by transformers:
transformers 5 holds the experts fused and the router as a module of its own, which compressed-tensors
(targets ["Linear"]) does not quantize, so the per-expert checkpoint transformers' save_pretrained
writes is rebuilt as transformers 4's module tree (an nn.Linear per expert projection and router:
:class:`CheckpointLinears`) and quantized, compressed and saved as llm-compressor does it
(quant_support._save_ct, with the families' ignore patterns of llm-compressor's MoE examples). The oracle
is transformers over compressed-tensors' own decompression of the saved tensors (PEFT on it for the
adapters): greedy tokens equal and logprobs within 1e-4 (fp32, CPU).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine_support import assert_churn_exact, churn_adapters
from factories import save_lora
from lora_runner import LLMEngine
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.moe import SparseMoeBlock
from lora_runner.model.quant.fp8 import FP8_DTYPE
from quant_support import _save_ct, ct_decompressed_tensors
from test_moe import assert_engine_greedy_equals, build_moe

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's own warnings on target_parameters

ATOL = 1e-4
# the ignore lists of llm-compressor's MoE FP8 examples: the router (Mixtral's without "$"), Qwen2-MoE's
# shared expert gate; the saved config names each ignored module (compressed-tensors expands the patterns)
IGNORE = {"qwen3_moe": ("lm_head", "re:.*mlp.gate$"), "mixtral": ("lm_head", "re:.*block_sparse_moe.gate"),
          "qwen2_moe": ("lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$")}


class CheckpointLinears(nn.Module):
    """A checkpoint's tensors as transformers 4's module tree: an nn.Linear at every 2-D ``<path>.weight``
    but the embeddings' (each expert's projections and the router included), every other tensor a
    buffer of its module. ``save_pretrained`` writes the state dict under the checkpoint's names."""

    def __init__(self, tensors: dict[str, torch.Tensor], config):
        super().__init__()
        self.config = config
        linears = {name[:-len(".weight")] for name, t in tensors.items()
                   if name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name}
        for path in sorted(linears):
            weight, bias = tensors[f"{path}.weight"], tensors.get(f"{path}.bias")
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            with torch.no_grad():
                linear.weight.copy_(weight)
                if bias is not None:
                    linear.bias.copy_(bias)
            parent, leaf = self._parent(path)
            parent.add_module(leaf, linear)
        for name, tensor in tensors.items():
            if name.rpartition(".")[0] not in linears:
                parent, leaf = self._parent(name)
                parent.register_buffer(leaf, tensor.clone())

    def _parent(self, path: str) -> tuple[nn.Module, str]:
        """(the module holding ``path``'s last part, created as empty modules where missing; that part)."""
        *parents, leaf = path.split(".")
        module = self
        for part in parents:
            if not hasattr(module, part):
                module.add_module(part, nn.Module())
            module = getattr(module, part)
        return module, leaf

    def save_pretrained(self, path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        state = {name: tensor.contiguous() for name, tensor in self.state_dict().items()}
        save_file(state, str(Path(path) / "model.safetensors"), metadata={"format": "pt"})
        self.config.save_pretrained(str(path))


def save_ct_fp8_moe(path, family: str, strategy: str = "channel", seed: int = 0,
                    ignore: tuple[str, ...] | None = None) -> None:
    """A tiny random MoE of ``family`` (tests/test_moe.py) saved as a compressed-tensors FP8 checkpoint: weights
    per ``strategy`` ("channel": dynamic per-token FP8 activations, FP8_DYNAMIC; "tensor": weight-only),
    Linears named by ``ignore`` (default: IGNORE[family]) left float."""
    from compressed_tensors.quantization import QuantizationArgs

    hf = build_moe(family, seed)
    with tempfile.TemporaryDirectory() as float_dir:
        hf.save_pretrained(float_dir)  # the per-expert names Hub checkpoints use
        tensors = load_file(str(Path(float_dir) / "model.safetensors"))
    weights = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    acts = (QuantizationArgs(num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True)
            if strategy == "channel" else None)
    dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
    _save_ct(path, CheckpointLinears(tensors, hf.config), weights, acts,
             lambda weight: (weight.amin(**dims), weight.amax(**dims)), ignore=ignore or IGNORE[family])


def ct_moe_oracle(path):
    """transformers (fp32) over compressed-tensors' decompression of the checkpoint at ``path``, loaded by
    from_pretrained from the per-expert names (which stacks the experts as transformers 5 holds them)."""
    from transformers import AutoModelForCausalLM

    raw = json.loads((Path(path) / "config.json").read_text())
    del raw["quantization_config"]
    with tempfile.TemporaryDirectory() as float_dir:
        (Path(float_dir) / "config.json").write_text(json.dumps(raw))
        save_file(ct_decompressed_tensors(path), str(Path(float_dir) / "model.safetensors"), metadata={"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    model.config._name_or_path = str(path)  # PEFT adapters made on it name the served checkpoint
    return model


@pytest.fixture(scope="module")
def qwen2_tensor(tmp_path_factory):
    """(checkpoint dir, oracle) of Qwen2-MoE (shared expert, its gate ignored) with per-tensor FP8 scales."""
    path = tmp_path_factory.mktemp("qwen2_moe-tensor")
    save_ct_fp8_moe(path, "qwen2_moe", "tensor", seed=3)
    return str(path), ct_moe_oracle(path)


def test_the_checkpoint_is_what_llm_compressor_writes(qwen2_tensor):
    """Guards the maker: per-expert FP8 weights with one scale per tensor, the routers and shared expert
    gates float and named one by one in ignore, as in Qwen3-30B-A3B-FP8-dynamic's config."""
    path, _ = qwen2_tensor
    tensors = load_file(str(Path(path) / "model.safetensors"))
    qcfg = json.loads((Path(path) / "config.json").read_text())["quantization_config"]
    assert tensors["model.layers.1.mlp.experts.3.gate_proj.weight"].dtype == FP8_DTYPE
    assert tensors["model.layers.1.mlp.experts.3.down_proj.weight_scale"].numel() == 1
    assert tensors["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert "model.layers.1.mlp.gate.weight_scale" not in tensors
    assert sorted(qcfg["ignore"]) == ["lm_head", "model.layers.1.mlp.gate", "model.layers.1.mlp.shared_expert_gate",
                                      "model.layers.2.mlp.gate", "model.layers.2.mlp.shared_expert_gate"]


def test_expert_weights_equal_the_library_decompression(qwen2_tensor):
    """Every expert's gate, up and down rows, the shared expert's, the router and the shared expert gate are
    compressed-tensors' decompression exactly: FP8 in memory, each slice's per-tensor scale on its rows."""
    path, oracle = qwen2_tensor
    model, _, _ = load_model(path)
    blocks = {i: layer.mlp for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoeBlock)}
    assert sorted(blocks) == [1, 2]
    for i, block in blocks.items():
        theirs = oracle.model.layers[i].mlp
        assert torch.equal(block.router.base_weight(), theirs.gate.weight)  # float32, as in the checkpoint
        assert torch.equal(block.shared_expert_gate.base_weight(), theirs.shared_expert_gate.weight)
        shared = theirs.shared_expert
        assert torch.equal(block.shared_expert.gate_up.base_weight(),
                           torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
        for e, expert in enumerate(block.experts):
            assert expert.gate_up.weight.dtype == FP8_DTYPE
            assert torch.equal(expert.gate_up.base_weight(), theirs.experts.gate_up_proj[e])  # [2I, H]
            assert torch.equal(expert.down.base_weight(), theirs.experts.down_proj[e])  # [H, I]
            gate_scales, up_scales = expert.gate_up.weight_scale.chunk(2)  # one scale per tensor, on each slice
            assert gate_scales.unique().numel() == up_scales.unique().numel() == 1 and gate_scales[0] != up_scales[0]


@pytest.mark.parametrize("family,strategy", [("qwen3_moe", "channel"), ("mixtral", "tensor"), ("qwen2_moe", "channel")])
def test_engine_greedy_equals_decompressed_oracle(family, strategy, tmp_path, greedy_oracle):
    save_ct_fp8_moe(tmp_path, family, strategy, seed=11)
    assert_engine_greedy_equals(str(tmp_path), ct_moe_oracle(tmp_path), greedy_oracle)


def test_mixed_batch_of_peft_expert_and_attention_adapters(qwen2_tensor, tmp_path, greedy_oracle):
    """PEFT target_parameters LoRA on the fused experts (+ q_proj), a PEFT attention-only LoRA and the base
    model, three over two slots (LRU paging), each against PEFT's forward over the decompressed model."""
    path, oracle = qwen2_tensor
    adapters = {
        "experts": (str(tmp_path / "experts"), save_lora(
            oracle, tmp_path / "experts", seed=5, r=3, lora_alpha=6, target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])),
        "attention": (str(tmp_path / "attention"), save_lora(oracle, tmp_path / "attention", seed=6, r=4,
                                                             target_modules=("q_proj", "o_proj"))),
    }
    engine = LLMEngine(path, dtype="float32", max_num_seqs=4, max_model_len=40, max_loras=1, max_lora_rank=8,
                       max_cpu_loras=2, block_size=4, max_num_batched_tokens=16)
    requests, done = churn_adapters(engine, adapters, max_prompt=12)
    assert_churn_exact(requests, done, lambda name: adapters[name][1] if name else oracle, greedy_oracle, ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_tp2_equals_tp1_for_a_mixed_batch_of_expert_adapters(strategy, tmp_path):
    """tests/test_moe_tp.py's mixed batch (per-expert, fused, router, attention-only and DoRA adapters, a soft
    prompt, evictions, preemption) on a compressed-tensors FP8 Qwen2-MoE: each rank reads its rows of every
    expert's gate_up with their scales and its columns of down with the whole rows' scales, so tp=2 equals
    tp=1."""
    from factories import save_prompt_adapter
    from test_moe_tp import serve, write_adapters

    save_ct_fp8_moe(tmp_path / "model", "qwen2_moe", strategy, seed=43)
    model_dir, oracle = str(tmp_path / "model"), ct_moe_oracle(tmp_path / "model")
    dirs = write_adapters(tmp_path, oracle, ModelConfig.from_dir(model_dir).spec())
    save_prompt_adapter(oracle, tmp_path / "soft", num_virtual_tokens=4, seed=7)
    want, _ = serve(model_dir, dirs, str(tmp_path / "soft"), 1)
    got, tp2 = serve(model_dir, dirs, str(tmp_path / "soft"), 2)
    assert tp2.adapters.manager.stats.lora_evictions > 0 and set(got) == set(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        for step, token in enumerate(tokens):
            assert abs(got[rid][1][step][token] - logprobs[step][token]) <= 1e-5, (rid, step)


def test_a_quantized_router_is_refused_naming_it(tmp_path):
    """A checkpoint whose router is FP8 (ignore left it in): the router is read float only, so refused."""
    save_ct_fp8_moe(tmp_path, "qwen3_moe", seed=12, ignore=("lm_head",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight.*MoE router"):
        load_model(str(tmp_path))


def _raw(family: str, ignore: list[str]) -> dict:
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                                                 "strategy": "channel"}}
    qcfg = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
            "config_groups": {"group_0": scheme}}
    architecture = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                    "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    return build_moe(family).config.to_dict() | {"architectures": [architecture], "quantization_config": qcfg}


@pytest.mark.parametrize("family,ignore", [
    ("qwen3_moe", ["lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]),
    ("qwen3_moe", ["re:.*lm_head", "re:.*mlp.gate$", "re:visual.*"]),  # a pattern no linear of ours matches
    ("mixtral", ["lm_head", "re:.*block_sparse_moe.gate"]),
    ("qwen2_moe", ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]),
    ("qwen2_moe", ["lm_head"]),  # transformers 5's router is no Linear: a checkpoint made there names none
])
def test_ignore_naming_only_routers_and_shared_expert_gates_is_read(family, ignore):
    quant = ModelConfig.from_dict(_raw(family, ignore)).quantization
    assert (quant.kind, quant.source, quant.fp8.online) == ("fp8", "compressed-tensors", False)


@pytest.mark.parametrize("family,entry,left_out", [
    ("qwen3_moe", "re:.*gate", "model.layers.0.mlp.experts.0.gate_proj"),  # the experts' gate_proj too
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2", "model.layers.1.block_sparse_moe.experts.2.w2"),
    ("qwen2_moe", "re:.*shared_expert", "model.layers.1.mlp.shared_expert.gate_proj"),
    ("qwen3_moe", "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.gate_proj"),  # the dense layer's MLP
])
def test_ignore_leaving_out_a_quantized_linear_is_refused_naming_it(family, entry, left_out):
    message = rf"quantization_config\.ignore entry '{re.escape(entry)}' leaves {re.escape(left_out)} unquantized"
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(_raw(family, ["lm_head", entry]))


def test_a_bad_ignore_pattern_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"quantization_config\.ignore entry 're:\(\.\*gate' is not a regular"):
        ModelConfig.from_dict(_raw("mixtral", ["lm_head", "re:(.*gate"]))
