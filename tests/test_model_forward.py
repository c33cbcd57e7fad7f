"""Our decoder over the paged cache vs transformers (fp32, max abs diff <= 1e-4) on tiny checkpoints.

Every case covers one or more options: GQA, sharded safetensors, tied embeddings, biases, rope
scaling (linear, llama3, yarn, dynamic), Mistral's and Qwen2's sliding windows. Each scenario is a
sequence of steps (prefill batch, decodes, mixed prefill+decode, chunked prefill) compared at every
new token with transformers' full-forward logits of the same sequence.
"""

from __future__ import annotations

import pytest
import torch

from test_model_harness import PagedDriver, assert_close, hf_logits, make_checkpoint

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-tied-sharded-llama3": dict(arch="llama", tie_word_embeddings=True, max_shard_size="40KB",
                                      rope_parameters=LLAMA3),
    "llama-bias-linear-mha": dict(arch="llama", biases=True, attention_bias=True, mlp_bias=True,
                                  num_key_value_heads=4,
                                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    "llama-yarn": dict(arch="llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                      "original_max_position_embeddings": 32}),
    "mistral-window": dict(arch="mistral", sliding_window=5, num_key_value_heads=1),
    "qwen2-window-sharded": dict(arch="qwen2", biases=True, use_sliding_window=True, sliding_window=6,
                                 max_window_layers=1, max_shard_size="40KB"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def ckpt(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CASES[request.param])


def _tokens(gen: torch.Generator, n: int) -> torch.Tensor:
    return torch.randint(3, 256, (n,), generator=gen)


class Oracle:
    """transformers' logits of each full sequence, computed once; tracks how far each sequence got.

    Causal attention makes row p of a full sequence's logits the logits after its first p+1 tokens.
    """

    def __init__(self, hf_model, full: dict[int, torch.Tensor]):
        self.hf_model, self.full = hf_model, full
        self.logits: dict[int, torch.Tensor] = {}
        self.start = dict.fromkeys(full, 0)

    def check(self, chunks, logits, what: str) -> None:
        for (seq_id, tokens), got in zip(chunks, logits):
            if seq_id not in self.logits:
                self.logits[seq_id] = hf_logits(self.hf_model, self.full[seq_id])
            first = self.start[seq_id]
            assert_close(got, self.logits[seq_id][first:first + len(tokens)], f"{what}, sequence {seq_id}")
            self.start[seq_id] = first + len(tokens)


def test_prefill_batch(ckpt):
    """Three prompts of different lengths in one flat batch."""
    gen = torch.Generator().manual_seed(1)
    prompts = {0: _tokens(gen, 3), 1: _tokens(gen, 11), 2: _tokens(gen, 7)}
    chunks = list(prompts.items())
    Oracle(ckpt.hf, prompts).check(chunks, PagedDriver(ckpt.model, ckpt.config).step(chunks), "prefill")


def test_decode_steps(ckpt):
    """Two prompts, then eight decode steps of both; block_size 4 so sequences span several blocks."""
    gen = torch.Generator().manual_seed(2)
    full = {0: _tokens(gen, 5 + 8), 1: _tokens(gen, 9 + 8)}
    oracle, driver = Oracle(ckpt.hf, full), PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=3)
    chunks = [(0, full[0][:5]), (1, full[1][:9])]
    oracle.check(chunks, driver.step(chunks), "prompt")
    for step in range(8):
        chunks = [(s, full[s][oracle.start[s]:oracle.start[s] + 1]) for s in full]
        oracle.check(chunks, driver.step(chunks), f"decode step {step}")


def test_mixed_prefill_and_decode(ckpt):
    """One sequence decodes while another prefills in the same step (with graph-style padding)."""
    gen = torch.Generator().manual_seed(4)
    full = {0: _tokens(gen, 9), 1: _tokens(gen, 9)}
    oracle, driver = Oracle(ckpt.hf, full), PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=5)
    chunks = [(0, full[0][:6])]
    oracle.check(chunks, driver.step(chunks), "first prompt")
    chunks = [(0, full[0][6:7]), (1, full[1][:7])]
    oracle.check(chunks, driver.step(chunks, num_padding=3), "decode + prefill")
    for step in range(2):
        chunks = [(1, full[1][7 + step:8 + step]), (0, full[0][7 + step:8 + step])]
        oracle.check(chunks, driver.step(chunks), f"decode both, step {step}")


def test_chunked_prefill(ckpt):
    """A 13-token prompt split 5 + 8 (not block-aligned) while another sequence decodes alongside."""
    gen = torch.Generator().manual_seed(6)
    full = {0: _tokens(gen, 14), 1: _tokens(gen, 6)}
    oracle, driver = Oracle(ckpt.hf, full), PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=7)
    steps = [[(1, full[1][:4]), (0, full[0][:5])],
             [(0, full[0][5:13]), (1, full[1][4:5])],
             [(0, full[0][13:]), (1, full[1][5:6])]]
    for what, chunks in zip(("first chunk", "second chunk", "decode after the chunks"), steps):
        oracle.check(chunks, driver.step(chunks), what)


def test_dynamic_ntk_rope_matches_cached_generation(tmp_path):
    """'dynamic' rope past max_position_embeddings vs transformers fed chunk by chunk with its KV cache."""
    from transformers import DynamicCache

    ckpt = make_checkpoint(tmp_path, "llama", max_position_embeddings=16,
                           rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    gen = torch.Generator().manual_seed(8)
    tokens = _tokens(gen, 26)
    steps = [12, 6] + [1] * 8  # prefill, a chunk that crosses 16, then decodes
    driver = PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=9)
    cache, start = DynamicCache(config=ckpt.hf.config), 0
    for n in steps:
        chunk = tokens[start:start + n]
        with torch.no_grad():
            expected = ckpt.hf(chunk[None], past_key_values=cache, use_cache=True).logits[0]
        (got,) = driver.step([(0, chunk)])
        assert_close(got, expected, f"dynamic rope, tokens {start}..{start + n}")
        start += n
    # sanity: the scaled frequencies really differ from plain RoPE here
    plain = make_checkpoint(tmp_path / "plain", "llama", max_position_embeddings=16)
    (base_logits,) = PagedDriver(plain.model, plain.config).step([(0, tokens)])
    assert (base_logits[-1] - hf_logits(ckpt.hf, tokens)[-1]).abs().max() > 1e-3


def test_fp16_prefill_close_to_fp32(tmp_path):
    """Half-precision weights and cache: logits stay close to the fp32 model's."""
    from lora_runner.model import load_model

    ckpt = make_checkpoint(tmp_path, "llama")
    half, config, _ = load_model(ckpt.path, dtype="float16")
    assert half.embed_tokens.dtype == torch.float16
    tokens = _tokens(torch.Generator().manual_seed(10), 9)
    driver = PagedDriver(half, config)
    driver.kv_cache = driver.kv_cache.half()
    (got,) = driver.step([(0, tokens)])
    assert got.dtype == torch.float32
    assert_close(got, hf_logits(ckpt.hf, tokens), "fp16 prefill", atol=0.1)
