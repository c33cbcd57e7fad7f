"""SamplingParams and EngineConfig validation: clear ValueErrors, defaults applied."""

import pytest
import torch

from lora_runner import EngineConfig, SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams(top_k=None, stop_token_ids=(5, 6))
    assert p.top_k == -1 and p.stop_token_ids == [5, 6] and not p.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=-2), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logprobs=-1), "logprobs"),
    (dict(seed="x"), "seed"),
])
def test_sampling_params_out_of_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(model=""), "model"),
    (dict(max_loras=0), "max_loras"),
    (dict(max_lora_rank=0), "max_lora_rank"),
    (dict(max_loras=4, max_cpu_loras=2), "max_cpu_loras"),
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=0), "max_model_len"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(kv_cache_memory_bytes=-5), "kv_cache_memory_bytes"),
    (dict(max_prompt_adapters=2), "max_prompt_adapter_tokens"),
    (dict(device="tpu"), "device"),
    (dict(dtype="float8"), "dtype"),
    (dict(dtype=torch.int8), "dtype"),
    (dict(max_num_seqs=True), "max_num_seqs"),
])
def test_engine_config_rejects(kwargs, match):
    kwargs = {"model": "some/model", **kwargs}
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_engine_config_resolves_auto_and_limits():
    cfg = EngineConfig("some/model", device="cpu", max_num_seqs=4)
    assert cfg.torch_device() == torch.device("cpu") and cfg.torch_dtype() == torch.float32
    assert cfg.cpu_loras == 16
    limits = cfg.limits(max_position_embeddings=512, kv_bytes_per_token=100)
    assert limits.max_model_len == 512 and limits.max_blocks_per_seq == 32
    assert limits.num_kv_blocks == 4 * 32  # enough for max_num_seqs full-length requests
    assert limits.max_num_batched_tokens == 512
    assert EngineConfig("m", dtype="bf16").torch_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineConfig("m", max_model_len=1024).limits(512, 100)
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        EngineConfig("m", kv_cache_memory_bytes=1000, block_size=16).limits(512, 100)
    assert EngineConfig("m", kv_cache_memory_bytes=16 * 100 * 40).limits(512, 100).num_kv_blocks == 40
