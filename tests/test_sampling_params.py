"""SamplingParams and EngineConfig validation: clear ValueErrors, defaults applied."""


import pytest
import torch

from lora_runner import EngineConfig, SamplingParams
from lora_runner.executor.limits import engine_limits
from lora_runner.sample.sampler import Sampler
from lora_runner.sampling_params import MAX_STOP_TOKEN_IDS


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
    (dict(logprobs=-2), "logprobs"),  # -1 is the whole vocabulary (vLLM)
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
    limits = engine_limits(cfg, max_position_embeddings=512, kv_bytes_per_token=100)
    assert limits.max_model_len == 512 and limits.max_blocks_per_seq == 32
    assert limits.num_kv_blocks == 4 * 32  # enough for max_num_seqs full-length requests
    assert limits.max_num_batched_tokens == 512
    assert EngineConfig("m", dtype="bf16").torch_dtype() == torch.bfloat16
    with pytest.raises(ValueError, match="max_position_embeddings"):
        engine_limits(EngineConfig("m", max_model_len=1024), 512, 100)
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        engine_limits(EngineConfig("m", kv_cache_memory_bytes=1000, block_size=16), 512, 100)
    assert engine_limits(EngineConfig("m", kv_cache_memory_bytes=16 * 100 * 40), 512, 100).num_kv_blocks == 40


# ---------------------------------------------------------------- full validation, copies
def _after(**changes):
    """Valid params with fields changed after construction, as a caller may do."""
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for name, value in changes.items():
        setattr(params, name, value)
    return params


@pytest.mark.parametrize("kwargs, match", [
    (dict(logprobs=True), "logprobs"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(top_k=True), "top_k"),
    (dict(seed=True), "seed"),
    (dict(seed=2**70), "seed"),
    (dict(temperature="hot"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=None), "top_p"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(stop_token_ids="5"), "stop_token_ids"),
    (dict(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1))), "stop_token_ids"),
])
def test_wrong_types_are_value_errors_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=match):  # the same value set after construction
        _after(**kwargs).validate()


def test_validate_applies_the_engines_limits():
    SamplingParams(logprobs=20).validate(max_logprobs=20, vocab_size=256)
    with pytest.raises(ValueError, match="logprobs=21 is over the engine's max_logprobs"):
        SamplingParams(logprobs=21).validate(max_logprobs=20, vocab_size=256)
    with pytest.raises(ValueError, match="logprobs=257 is over the vocabulary size"):
        SamplingParams(logprobs=257).validate(max_logprobs=1000, vocab_size=256)
    SamplingParams(stop_token_ids=[0, 255]).validate(vocab_size=256)
    with pytest.raises(ValueError, match=r"stop_token_ids must lie in \[0, 256\)"):
        SamplingParams(stop_token_ids=[3, 256]).validate(vocab_size=256)
    for bad in (None, {1, 2}, 7):
        with pytest.raises(ValueError, match="stop_token_ids must be a list"):
            _after(stop_token_ids=bad).validate()
    assert EngineConfig("m").max_logprobs == 20  # vLLM's default


class CountingList(list):
    """A list that counts the elements read through iteration or indexing (a scan reads them all)."""

    def __init__(self, items):
        super().__init__(items)
        self.reads = 0

    def __iter__(self):
        for item in super().__iter__():
            self.reads += 1
            yield item

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_five_million_stop_ids_are_refused_without_being_scanned():
    huge = CountingList(range(5_000_000))
    with pytest.raises(ValueError, match=f"5000000 entries, more than the limit of {MAX_STOP_TOKEN_IDS}"):
        _after(stop_token_ids=huge).clone().validate()
    with pytest.raises(ValueError, match="5000000 entries"):
        SamplingParams(stop_token_ids=huge)
    assert huge.reads == 0  # refused by its length: no id was read


def test_clone_shares_nothing_mutable():
    params = SamplingParams(stop_token_ids=[5, 6], top_k=3, logprobs=2)
    copy = params.clone()
    params.stop_token_ids.append(7)
    params.top_k, params.logprobs = 9, 4
    assert copy.stop_token_ids == [5, 6] and copy.top_k == 3 and copy.logprobs == 2
    assert _after(top_k=None).clone().top_k == -1
    assert _after(stop_token_ids=(4, 5)).clone().stop_token_ids == [4, 5]


def test_temperatures_below_1e_5_are_greedy():
    assert all(SamplingParams(temperature=t).greedy for t in (0, 0.0, 1e-40, 9.9e-6))
    assert not any(SamplingParams(temperature=t).greedy for t in (1e-5, 0.01, 1.0))
    logits = torch.randn(4, 50) * 5
    logits[:, 0] = -10.0  # token 0 is never the argmax
    sampler = Sampler(50, "cpu")
    params = [SamplingParams(temperature=t) for t in (1e-40, 1e-30, 1e-7, 0.0)]
    out = sampler(logits, sampler.make_batch(params, [None] * 4))
    assert out.token_ids == logits.argmax(-1).tolist() and out.errors == [None] * 4


@pytest.mark.parametrize("value", [-2, 2.5, True, "20"])  # -1: no cap (vLLM's)
def test_engine_config_max_logprobs(value):
    with pytest.raises(ValueError, match="max_logprobs"):
        EngineConfig("m", max_logprobs=value)
