"""4-bit checkpoints end to end: GPTQ (v1 layout, symmetric) and AWQ (GEMM layout, zero points) directories
written in each format's documented layout (tests/test_quant_int4_formats.write_int4_checkpoint) load through
the engine's loader and serve the base model and a PEFT LoRA in one batch, against transformers holding the
dequantized weights in float64."""

import copy
import shutil

import pytest
import torch

from adapters import LoRARequest
from lora_runner import SamplingParams

from engine_support import assert_exact, greedy_decode, make_engine, run_to_completion
from factories import save_lora, save_tiny_model
from test_quant_int4_formats import write_int4_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)


def _int4_checkpoint(tmp_path, quant_method: str, seed: int):
    """(float model, its dequantized twin in fp32): a tiny Llama written to tmp_path/"model" in `quant_method`'s
    layout (group 32) with its tokenizer; the twin holds the weights the checkpoint dequantizes to."""
    hf = save_tiny_model(tmp_path / "float", "llama", seed=seed)
    dequantized = write_int4_checkpoint(hf, tmp_path / "model", quant_method, group_size=32)
    for item in (tmp_path / "float").iterdir():  # the tokenizer files
        if item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, tmp_path / "model" / item.name)
    twin = copy.deepcopy(hf).eval()
    for module, weight in dequantized.items():
        twin.get_submodule(module).weight.data.copy_(weight)
    return hf, twin


def _serves_base_and_lora(engine, oracle, oracle_lora, lora_dir) -> None:
    """A base and a LoRA request in one batch, each greedy-exact against its oracle (logprobs within 1e-3)."""
    done = run_to_completion(engine, [("base", [5, 6, 7], GREEDY),
                                      ("lora", [8, 9, 10, 11], GREEDY, LoRARequest("l", str(lora_dir)))])
    assert_exact(done["base"], oracle, [5, 6, 7], greedy_decode, 5, tolerance=1e-3)
    assert_exact(done["lora"], oracle_lora, [8, 9, 10, 11], greedy_decode, 5, tolerance=1e-3)


@pytest.mark.parametrize("quant_method", ["gptq", "awq"])
def test_a_4bit_checkpoint_serves_base_and_lora_against_its_dequantized_twin(tmp_path, quant_method):
    from peft import PeftModel

    hf, twin = _int4_checkpoint(tmp_path, quant_method, seed=3)
    oracle = twin.double()
    save_lora(hf, tmp_path / "lora", seed=7, scale=0.15)
    oracle_lora = PeftModel.from_pretrained(copy.deepcopy(oracle), str(tmp_path / "lora")).double().eval()

    engine = make_engine(str(tmp_path / "model"))
    qkv = engine.model.layers[0].self_attn.qkv
    assert qkv.qweight.dtype == torch.int32 and not hasattr(qkv, "weight")  # it stays 4-bit in memory
    assert (qkv.zeros is None) == (quant_method == "gptq")
    _serves_base_and_lora(engine, oracle, oracle_lora, tmp_path / "lora")


def test_a_compressed_tensors_w4a16_checkpoint_serves_against_the_librarys_decompression(tmp_path):
    """A W4A16 (pack-quantized, symmetric, group 32) checkpoint made by compressed-tensors itself; the oracle
    is the library's own decompression in transformers, with a PEFT LoRA in the same batch."""
    from peft import PeftModel

    from quant_support import ct_decompressed, save_ct_w4a16

    save_ct_w4a16(tmp_path / "model", group_size=32, seed=5)
    oracle = ct_decompressed(tmp_path / "model").double()
    save_lora(save_tiny_model(tmp_path / "float", "llama", seed=5), tmp_path / "lora", seed=8, scale=0.15)
    oracle_lora = PeftModel.from_pretrained(copy.deepcopy(oracle), str(tmp_path / "lora")).double().eval()
    engine = make_engine(str(tmp_path / "model"))
    gate_up = engine.model.layers[0].mlp.gate_up
    assert gate_up.qweight.dtype == torch.int32 and gate_up.zeros is None and not hasattr(gate_up, "weight")
    _serves_base_and_lora(engine, oracle, oracle_lora, tmp_path / "lora")


def test_vocab_lora_and_a_soft_prompt_on_a_4bit_base(tmp_path):
    """Embedding / lm_head LoRA and a prompt adapter (with and without a LoRA) over a GPTQ base, in one batch,
    against PEFT on the dequantized twin: the quantized base changes nothing about the adapters' paths."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from adapters import PromptAdapterRequest
    from factories import save_prompt_adapter
    from test_prompt_adapters import SoftPromptOnLoRA

    hf, oracle = _int4_checkpoint(tmp_path, "gptq", seed=4)
    save_lora(hf, tmp_path / "vocab", seed=23, r=8, scale=0.2,
              target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj", "down_proj"])
    save_prompt_adapter(hf, tmp_path / "soft", num_virtual_tokens=3, seed=5)
    soft = load_file(str(tmp_path / "soft" / "adapter_model.safetensors"))["prompt_embeddings"]
    oracles = {"vocab": PeftModel.from_pretrained(copy.deepcopy(oracle), str(tmp_path / "vocab")).eval(),
               "soft+vocab": SoftPromptOnLoRA(oracle, str(tmp_path / "vocab"), soft)}
    engine = make_engine(str(tmp_path / "model"), max_prompt_adapters=1, max_prompt_adapter_tokens=4)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    vocab, pa = LoRARequest("vocab", str(tmp_path / "vocab")), PromptAdapterRequest("soft", str(tmp_path / "soft"))
    done = run_to_completion(engine, [("vocab", [5, 6, 7], params, vocab),
                                      ("soft+vocab", [8, 9, 10], params, vocab, pa), ("base", [11, 12], params)])
    assert_exact(done["vocab"], oracles["vocab"], [5, 6, 7], greedy_decode, 4, tolerance=1e-3)
    assert_exact(done["soft+vocab"], oracles["soft+vocab"], [8, 9, 10], greedy_decode, 4, tolerance=1e-3)
    assert_exact(done["base"], oracle, [11, 12], greedy_decode, 4, tolerance=1e-3)
