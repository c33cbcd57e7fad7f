"""SamplingParams.prompt_logprobs (vLLM's semantics) against PEFT's forward: base, LoRA and soft prompt,
across chunked prefill, next to requests that ask for none, and past a cached prefix (the bypass)."""

from __future__ import annotations

import pytest
import torch
from engine_support import assert_idle, make_engine, run_to_completion
from factories import save_lora, save_prompt_adapter

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner import SamplingParams
from lora_runner.sample.prompt_logprobs import PromptSpan, score_spans

CHUNK = 8  # max_num_batched_tokens: the long prompt takes three prefill steps
NUM_VIRTUAL = 4
TOLERANCE = 1e-4


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=gen).tolist()


def peft_prompt_logprobs(model, prompt: list[int], num_virtual: int = 0) -> torch.Tensor:
    """[len(prompt) - 1, V] float64 log_softmax of PEFT's float32 logits at the positions that predict
    prompt tokens 1.. (a soft prompt's rows, first in PEFT's logits, left out)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, num_virtual:]  # [L, V]
    return torch.log_softmax(logits.double(), dim=-1)[:-1]


def assert_prompt_logprobs(entries, prompt: list[int], want: torch.Tensor, k: int) -> None:
    """entries: RequestOutput.prompt_logprobs; want: peft_prompt_logprobs of the same prompt."""
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        entry, row = entries[j], want[j - 1]
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == set(top) | {prompt[j]}, (j, sorted(entry), top, prompt[j])
        for token, value in entry.items():
            assert abs(value - float(row[token])) <= TOLERANCE, (j, token, value, float(row[token]))


@pytest.fixture(scope="module")
def soft(engine_checkpoint, tmp_path_factory):
    """(soft prompt dir, its PeftModel) over the engine checkpoint."""
    _, hf, _ = engine_checkpoint
    path = tmp_path_factory.mktemp("soft") / "pa"
    return str(path), save_prompt_adapter(hf, path, num_virtual_tokens=NUM_VIRTUAL, seed=7)


@pytest.fixture(scope="module")
def head(engine_checkpoint, tmp_path_factory):
    """(dir, PeftModel) of a LoRA on lm_head (and q_proj): the prompt positions' logits need it too."""
    _, hf, _ = engine_checkpoint
    path = tmp_path_factory.mktemp("head") / "lora"
    return str(path), save_lora(hf, path, seed=8, r=8, lora_alpha=16, target_modules=["lm_head", "q_proj"])


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_peft_for_base_lora_and_soft_prompt(engine_checkpoint, soft, head, k):
    path, hf, adapters = engine_checkpoint
    lora_dir, lora_model = adapters["r4"]
    soft_dir, soft_model = soft
    head_dir, head_model = head
    engine = make_engine(path, max_num_batched_tokens=CHUNK, max_prompt_adapters=1, max_prompt_adapter_tokens=8,
                         poison=["kv_cache", "prompt_slots"])
    long, short = _prompt(21, seed=1), _prompt(6, seed=2)
    asks = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    requests = [("base", long, asks), ("lora", long, asks, LoRARequest("r4", lora_dir)),
                ("soft", short, asks, None, PromptAdapterRequest("soft", soft_dir)),
                ("head", long, asks, LoRARequest("head", head_dir)),
                ("bystander", short, plain, LoRARequest("r4", lora_dir))]
    done = run_to_completion(engine, requests)
    assert_prompt_logprobs(done["base"].prompt_logprobs, long, peft_prompt_logprobs(hf, long), k)
    assert_prompt_logprobs(done["lora"].prompt_logprobs, long, peft_prompt_logprobs(lora_model, long), k)
    assert_prompt_logprobs(done["head"].prompt_logprobs, long, peft_prompt_logprobs(head_model, long), k)
    assert_prompt_logprobs(done["soft"].prompt_logprobs, short, peft_prompt_logprobs(soft_model, short, NUM_VIRTUAL),
                           k)
    assert done["bystander"].prompt_logprobs is None
    assert_idle(engine)
    engine.close()


def test_prompt_logprobs_compute_a_cached_prefix_again(engine_checkpoint):
    path, hf, _ = engine_checkpoint
    engine = make_engine(path, enable_prefix_caching=True, max_num_batched_tokens=CHUNK)
    prompt = _prompt(19, seed=3)
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    first = run_to_completion(engine, [("warm", prompt, plain)])["warm"]
    scored = run_to_completion(engine, [("scored", prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                                          prompt_logprobs=2))])["scored"]
    again = run_to_completion(engine, [("again", prompt, plain)])["again"]
    assert first.num_cached_tokens == 0 and scored.num_cached_tokens == 0  # every prompt position ran
    assert again.num_cached_tokens > 0  # the prompt's blocks are cached all the same
    assert_prompt_logprobs(scored.prompt_logprobs, prompt, peft_prompt_logprobs(hf, prompt), 2)
    assert scored.outputs[0].token_ids == first.outputs[0].token_ids == again.outputs[0].token_ids
    engine.close()


def test_prompt_logprobs_of_parallel_samples_and_the_limit(engine_checkpoint):
    path, hf, _ = engine_checkpoint
    engine = make_engine(path, max_logprobs=4)
    prompt = _prompt(9, seed=4)
    with pytest.raises(ValueError, match="prompt_logprobs=5 is over the engine's max_logprobs"):
        engine.add_request("over", prompt, SamplingParams(prompt_logprobs=5))
    for bad in (-2, 1.5, True):  # -1 is the whole vocabulary (vLLM)
        with pytest.raises(ValueError, match="prompt_logprobs must be None or an integer"):
            SamplingParams(prompt_logprobs=bad)
    params = SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=2, prompt_logprobs=1)
    output = run_to_completion(engine, [("pair", prompt, params)])["pair"]
    assert len(output.outputs) == 2
    assert_prompt_logprobs(output.prompt_logprobs, prompt, peft_prompt_logprobs(hf, prompt), 1)
    assert_idle(engine)
    engine.close()


def test_prompt_positions_are_scored_in_bounded_pieces():
    """score_spans never asks for more than max_rows rows of logits at once, and the pieces give what one
    block of every position gives."""
    gen = torch.Generator().manual_seed(6)
    hidden, weight = torch.randn(30, 8, generator=gen), torch.randn(8, 50, generator=gen)
    targets = torch.randint(0, 50, (23,), generator=gen).numpy()
    spans = [PromptSpan("r", first=1, flat_start=4, targets=targets, k=2)]
    asked = []

    def logits_of(flat, rows):
        asked.append(len(flat))
        return rows @ weight

    pieces = score_spans(hidden, spans, logits_of, max_rows=5)["r"]
    assert max(asked) == 5 and sum(asked) == len(targets)
    whole = score_spans(hidden, spans, lambda flat, rows: rows @ weight, max_rows=64)["r"]
    assert pieces.first == whole.first == 1
    assert len(pieces.entries) == len(whole.entries) == len(targets)
    for target, piece_entry, whole_entry in zip(targets.tolist(), pieces.entries, whole.entries):
        assert target in whole_entry and len(whole_entry) in (2, 3)  # the top 2 and the prompt token
        assert piece_entry == pytest.approx(whole_entry)


def test_prompt_logprobs_survive_preemption(engine_checkpoint):
    """12 blocks of 4 tokens cannot hold four requests of up to 30 tokens: some are preempted, mid-prompt
    or after it, and compute their prompt again; their prompt logprobs are still one entry per token."""
    path, hf, _ = engine_checkpoint
    engine = make_engine(path, max_num_batched_tokens=CHUNK, kv_cache_memory_bytes=12 * 2048, max_model_len=40,
                         enable_prefix_caching=True)
    assert engine.block_manager.num_blocks == 12
    prompts = [_prompt(length, seed=10 + length) for length in (17, 13, 20, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, prompt_logprobs=2)
    done = run_to_completion(engine, [(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)], per_step=2)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        assert_prompt_logprobs(done[f"p{i}"].prompt_logprobs, prompt, peft_prompt_logprobs(hf, prompt), 2)
    engine.close()
