"""FP8 bases (issue 25): compressed-tensors FP8 checkpoints made by the compressed-tensors library, and
quantization="fp8" on a float checkpoint, served with LoRA and DoRA adapters in mixed batches.

Oracles: compressed-tensors' own decompression + transformers/PEFT (greedy-exact, logprobs within
1e-3); for online FP8 a float64 transformers model holding the same quantized weights."""

import copy

import pytest
import torch

from adapters import LoRARequest
from lora_runner import SamplingParams
from lora_runner.model import load_model
from lora_runner.model.quant.fp8 import FP8_DTYPE, FP8_MAX

from engine_support import assert_exact, greedy_decode, make_engine, run_to_completion
from factories import save_lora, save_tiny_model
from quant_support import ct_decompressed, edit_config, save_ct_fp8, weight_bytes

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
TOLERANCE = 1e-3
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [14, 15, 16, 17, 18], [19, 20, 21]]


@pytest.fixture(scope="module")
def ct_fp8(tmp_path_factory):
    """(checkpoint dir, decompressed oracle, {name: (adapter dir, PeftModel on the oracle)})."""
    root = tmp_path_factory.mktemp("ct_fp8")
    save_ct_fp8(root / "model")
    oracle = ct_decompressed(root / "model")
    adapters = {
        "lora": dict(seed=1, r=8, lora_alpha=16),
        "lora-qv": dict(seed=2, r=4, lora_alpha=8, target_modules=("q_proj", "v_proj")),
        "dora": dict(seed=3, r=8, lora_alpha=16, use_dora=True),
    }
    saved = {name: (str(root / name), save_lora(oracle, root / name, scale=0.15, **kwargs))
             for name, kwargs in adapters.items()}
    return str(root / "model"), oracle, saved


def _requests(adapters, names):
    return [(f"r{i}", PROMPTS[i % len(PROMPTS)], GREEDY, LoRARequest(name, adapters[name][0]) if name else None)
            for i, name in enumerate(names)]


def test_ct_fp8_base_and_mixed_adapter_batch_match_decompressed_oracle(ct_fp8, greedy_oracle):
    path, oracle, adapters = ct_fp8
    engine = make_engine(path, max_num_seqs=5, max_loras=3)
    qkv = engine.model.layers[0].self_attn.qkv
    assert qkv.weight.dtype == FP8_DTYPE and qkv.weight_scale.dtype == torch.float32  # kept quantized
    names = [None, "lora", "dora", "lora-qv", None]
    requests = _requests(adapters, names)
    done = run_to_completion(engine, requests)
    for (request_id, prompt, _, _), name in zip(requests, names):
        model = adapters[name][1] if name else oracle
        assert_exact(done[request_id], model, prompt, greedy_oracle, 5, tolerance=TOLERANCE)


def test_ct_fp8_weights_equal_the_library_decompression(ct_fp8):
    path, oracle, _ = ct_fp8
    model, _, _ = load_model(path)
    for layer, theirs in zip(model.layers, oracle.model.layers):
        packed = {"qkv": [theirs.self_attn.q_proj, theirs.self_attn.k_proj, theirs.self_attn.v_proj],
                  "o": [theirs.self_attn.o_proj], "gate_up": [theirs.mlp.gate_proj, theirs.mlp.up_proj],
                  "down": [theirs.mlp.down_proj]}
        ours = {"qkv": layer.self_attn.qkv, "o": layer.self_attn.o, "gate_up": layer.mlp.gate_up,
                "down": layer.mlp.down}
        for name, modules in packed.items():
            torch.testing.assert_close(ours[name].base_weight(), torch.cat([m.weight for m in modules]),
                                       rtol=0, atol=0)


def test_per_tensor_scales_stay_per_slice_in_the_packed_qkv(tmp_path):
    save_ct_fp8(tmp_path, strategy="tensor", activations=False)
    oracle = ct_decompressed(tmp_path)
    engine = make_engine(str(tmp_path))
    qkv = engine.model.layers[0].self_attn.qkv
    scales = qkv.weight_scale.split(qkv.slice_sizes)
    assert all(s.unique().numel() == 1 for s in scales)  # one scale per slice ...
    assert len({float(s[0]) for s in scales}) == 3  # ... and each slice its own
    requests = [(f"b{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:3])]
    done = run_to_completion(engine, requests)
    for request_id, prompt, _ in requests:
        assert_exact(done[request_id], oracle, prompt, greedy_decode, 5, tolerance=TOLERANCE)


def test_fp8_tensors_without_quantization_config_are_refused(tmp_path):
    save_ct_fp8(tmp_path)
    edit_config(tmp_path, lambda raw: raw.pop("quantization_config"))
    with pytest.raises(ValueError, match="float8_e4m3fn.*no quantization_config"):
        load_model(str(tmp_path))


def test_missing_weight_scale_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    save_ct_fp8(tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    del tensors["model.layers.1.self_attn.k_proj.weight_scale"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight_scale"):
        load_model(str(tmp_path))


def _float64_twin(hf, model):
    """A float64 copy of transformers model `hf` whose decoder linears are `model`'s dequantized weights."""
    twin = copy.deepcopy(hf).double()
    with torch.no_grad():
        for ours, theirs in zip(model.layers, twin.model.layers):
            attn = theirs.self_attn
            pairs = [(ours.self_attn.qkv, [attn.q_proj, attn.k_proj, attn.v_proj]),
                     (ours.self_attn.o, [attn.o_proj]),
                     (ours.mlp.gate_up, [theirs.mlp.gate_proj, theirs.mlp.up_proj]),
                     (ours.mlp.down, [theirs.mlp.down_proj])]
            for linear, modules in pairs:
                rows = (linear.weight.double() * linear.weight_scale.double()[:, None]).split(linear.slice_sizes)
                for module, weight in zip(modules, rows):
                    module.weight.copy_(weight)
    return twin.eval()


def test_online_fp8_equals_float64_reference_of_its_weights(tmp_path, record_property):
    hf = save_tiny_model(tmp_path / "model", "llama", seed=4)
    save_lora(hf, tmp_path / "lora", seed=5, scale=0.15)
    engine = make_engine(str(tmp_path / "model"), quantization="fp8")
    model = engine.model
    for linear in (model.layers[0].self_attn.qkv, model.layers[1].mlp.down):
        assert linear.weight.dtype == FP8_DTYPE
        assert float(linear.weight.float().abs().amax(1).min()) == FP8_MAX  # each row's max hits the FP8 max
    twin = _float64_twin(hf, model)
    from peft import PeftModel

    twin_lora = PeftModel.from_pretrained(copy.deepcopy(twin), str(tmp_path / "lora")).double().eval()  # wraps in place
    requests = [("base", PROMPTS[0], GREEDY), ("lora", PROMPTS[1], GREEDY, LoRARequest("l", str(tmp_path / "lora")))]
    done = run_to_completion(engine, requests)
    assert_exact(done["base"], twin, PROMPTS[0], greedy_decode, 5, tolerance=TOLERANCE)
    assert_exact(done["lora"], twin_lora, PROMPTS[1], greedy_decode, 5, tolerance=TOLERANCE)
    # reported, not asserted: how far FP8 moves the logprobs of the unquantized model's tokens
    with torch.inference_mode():
        ids = torch.tensor([PROMPTS[3]])
        exact = torch.log_softmax(hf(ids).logits.double(), -1)
        quantized = torch.log_softmax(twin(ids).logits, -1)
    record_property("online_fp8_max_logprob_error_vs_fp32", float((exact - quantized).abs().max()))


@pytest.mark.parametrize("make", ["online", "compressed-tensors"])
def test_fp8_weights_take_at_most_055x_of_bf16(tmp_path, make):
    sizes = dict(vocab_size=32, hidden_size=256, intermediate_size=512, num_hidden_layers=1)
    if make == "online":
        save_tiny_model(tmp_path / "plain", "llama", tokenizer=False, **sizes)
        quantized, _, _ = load_model(str(tmp_path / "plain"), dtype=torch.bfloat16, quantization="fp8")
    else:
        save_ct_fp8(tmp_path / "fp8", **sizes)
        save_tiny_model(tmp_path / "plain", "llama", tokenizer=False, **sizes)
        quantized, _, _ = load_model(str(tmp_path / "fp8"), dtype=torch.bfloat16)
    plain, _, _ = load_model(str(tmp_path / "plain"), dtype=torch.bfloat16)
    assert weight_bytes(quantized) <= 0.55 * weight_bytes(plain), (weight_bytes(quantized), weight_bytes(plain))
