"""Config parsing, checkpoint resolution/loading and their errors, dtype/device helpers, KV cache sizing."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from factories import save_tiny_model, tiny_config, write_hub_cache
from lora_runner.model import (LlamaForCausalLM, ModelConfig, load_model, resolve_device, resolve_dtype,
                               resolve_model_dir)
from lora_runner.model.loader import weight_files
from lora_runner.worker.kv_cache import kv_block_bytes, num_kv_blocks
from lora_runner.worker.kv_cache import allocate_kv_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model(path, "llama", tokenizer=False)
    return path


def _config_dir(tmp_path, arch="llama", **overrides):
    tiny_config(arch, **overrides).save_pretrained(str(tmp_path))
    return tmp_path


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("arch,architecture", [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                                               ("qwen2", "Qwen2ForCausalLM")])
def test_config_fields_per_architecture(tmp_path, arch, architecture):
    hf = tiny_config(arch, num_hidden_layers=3, use_sliding_window=True, sliding_window=7, max_window_layers=2)
    hf.save_pretrained(str(tmp_path))
    config = ModelConfig.from_dir(tmp_path, name_or_path="org/tiny")
    assert config.architecture == architecture
    assert (config.vocab_size, config.hidden_size, config.num_layers, config.intermediate_size) == (256, 64, 3, 96)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.bos_token_id, config.eos_token_ids, config.max_position_embeddings) == (1, (2,), 512)
    assert config.rope.theta == 10000.0 and config.rope.rope_type == "default"
    assert config.qkv_bias == (arch == "qwen2") and not config.o_bias
    expected_windows = {"llama": [None] * 3, "mistral": [7] * 3, "qwen2": [None, None, 7]}[arch]
    assert [config.sliding_window(i) for i in range(3)] == expected_windows
    spec = config.spec()
    assert (spec.num_layers, spec.hidden_size, spec.head_dim, spec.model_name) == (3, 64, 16, "org/tiny")
    assert spec.slice_sizes("qkv") == (64, 32, 32)


def test_legacy_rope_format_and_eos_list():
    raw = tiny_config("llama").to_dict()
    raw.pop("rope_parameters", None)
    raw.update(rope_theta=500000.0, eos_token_id=[2, 7], rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    config = ModelConfig.from_dict(raw)
    assert config.rope.theta == 500000.0
    assert config.rope.scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    assert config.eos_token_ids == (2, 7)


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"),
    ({"architectures": [], "model_type": "gpt2"}, "neither 'architectures' nor a known 'model_type'"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope scaling type 'mrope'"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope' needs short_factor, long_factor"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, "needs factor"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"hidden_size": None}, "lacks 'hidden_size'"),
])
def test_bad_config_raises_value_error(tmp_path, llama_dir, change, message):
    shutil.copytree(llama_dir, tmp_path / "m")
    _edit_config(tmp_path / "m", **change)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path / "m"))


def test_missing_files_raise_file_not_found(tmp_path, llama_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))  # empty dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nowhere"))
    _config_dir(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin.*convert"):
        load_model(str(tmp_path))


def test_sharded_checkpoint_and_missing_shard(tmp_path):
    hf = save_tiny_model(tmp_path, "llama", tokenizer=False, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and [p.name for p in weight_files(tmp_path)] == shards
    model, _, _ = load_model(str(tmp_path))
    torch.testing.assert_close(model.layers[1].mlp.down.base_weight(), hf.model.layers[1].mlp.down_proj.weight)
    qkv = torch.cat([getattr(hf.model.layers[0].self_attn, f"{p}_proj").weight for p in "qkv"])
    torch.testing.assert_close(model.layers[0].self_attn.qkv.base_weight(), qkv)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1]):
        load_model(str(tmp_path))


def test_missing_or_misshapen_tensor_raises(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    save_file({k: v for k, v in tensors.items() if "layers.1.self_attn.k_proj" not in k},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv\.weight\[slice 1\]"):
        load_model(str(tmp_path))
    _edit_config(tmp_path, intermediate_size=80)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"_proj\.weight' has shape \(\d+, 96\), the model expects \(\d+, 80\)"):
        load_model(str(tmp_path))


def test_tied_embeddings_share_the_embedding(tmp_path):
    save_tiny_model(tmp_path, "llama", tokenizer=False, tie_word_embeddings=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    model, config, _ = load_model(str(tmp_path))
    assert config.tie_word_embeddings and model.lm_head is model.embed_tokens


def test_hub_cache_offline_by_branch_tag_and_commit(tmp_path, llama_dir, monkeypatch):
    import huggingface_hub.constants as hub_constants

    snapshot = write_hub_cache(tmp_path / "hub", "org/tiny-llama", llama_dir, COMMIT, refs=("main", "v1"))
    for revision in (None, "v1", COMMIT):
        assert resolve_model_dir("org/tiny-llama", revision=revision, local_files_only=True,
                                 cache_dir=tmp_path / "hub") == snapshot
    with pytest.raises(FileNotFoundError, match="org/tiny-llama.*'v2'"):
        resolve_model_dir("org/tiny-llama", revision="v2", local_files_only=True, cache_dir=tmp_path / "hub")
    with pytest.raises(FileNotFoundError, match="org/other"):
        resolve_model_dir("org/other", local_files_only=True, cache_dir=tmp_path / "hub")
    # load_model itself, with the offline switch and cache location taken from huggingface_hub
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    model, config, model_dir = load_model("org/tiny-llama", revision="v1")
    assert model_dir == snapshot and config.name_or_path == "org/tiny-llama"
    assert isinstance(model, LlamaForCausalLM)


def test_load_model_dtype_and_auto(llama_dir):
    model, _, _ = load_model(str(llama_dir), dtype="bfloat16", device="cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model, _, _ = load_model(str(llama_dir), dtype="auto", device="auto")
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert model.dtype == expected


def test_resolve_dtype_and_device():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16 and resolve_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("float8", torch.int32, None):
        with pytest.raises(ValueError, match="dtype"):
            resolve_dtype(bad, "cpu")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu-ish")


def test_kv_cache_shape_and_block_budget():
    config = ModelConfig.from_dict(tiny_config("llama", num_hidden_layers=3).to_dict())
    kv = allocate_kv_cache(config, num_blocks=5, block_size=8, dtype="float16", device="cpu")
    assert kv.shape == (3, 2, 5, 8, 2, 16) and kv.dtype == torch.float16  # not zeroed on CPU (allocate_kv_cache)
    per_block = 3 * 2 * 8 * 2 * 16 * 2
    assert kv_block_bytes(config, 8, torch.float16) == per_block == kv[:, :, :1].nbytes
    assert num_kv_blocks(config, 8, torch.float16, 10 * per_block + per_block - 1) == 10
    assert num_kv_blocks(config, 8, torch.float32, per_block - 1) == 0
    with pytest.raises(ValueError, match="auto"):
        num_kv_blocks(config, 8, "auto", 10**9)
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(config, 0, 8, torch.float32, "cpu")
