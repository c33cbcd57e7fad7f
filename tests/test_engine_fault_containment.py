"""Fault containment inside step(): a failure caused by one request
(its sampling, its detokenization, its soft-prompt placeholders, NaN/inf logits from a huge LoRA)
finishes that request with finish_reason "error" and the exception in ``.error``; every other
request in the step keeps exactly the tokens of a run without the fault. LLM.generate leaves
nothing live when a step raises under it.

Each test serves the bystanders twice on one engine, once without the fault (the reference) and
once with it, and compares token ids bit for bit.
"""

import logging
import threading

import huggingface_hub
import pytest
import torch

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner import LLM, SamplingParams
from lora_runner.core.request import Request
from lora_runner.sample.sampler import NonFiniteLogitsError, Sampler
from tests import factories
from engine_support import assert_exact, assert_idle, make_engine, run_to_completion
from test_engine_bad_adapters import OFFLINE

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
VICTIM_TEMPERATURE = 0.875  # exact in float32: marks the victim's row inside the sampler


class InjectedFault(RuntimeError):
    """The fault a test plants in one request's path."""


def bystanders(adapters):
    """id -> (prompt, params, LoRA): the base model, a LoRA and a seeded sampler at a high temperature."""
    return {"base": ([12, 13], GREEDY, None),
            "r4": ([5, 6, 7, 8], GREEDY, LoRARequest("r4", adapters["r4"][0])),
            "seeded": ([9, 10, 11], SamplingParams(temperature=3.0, seed=5, max_tokens=5, ignore_eos=True,
                                                   logprobs=2), None)}


def serve(engine, requests, prefix=""):
    """Add `requests` (id -> (prompt, params, LoRA)) and step to the end; id -> finished output."""
    for request_id, (prompt, params, lora) in requests.items():
        engine.add_request(prefix + request_id, prompt, params, lora_request=lora)
    done = run_to_completion(engine)
    return {request_id[len(prefix):]: output for request_id, output in done.items()}


def assert_same_tokens(outputs, reference, names):
    for name in names:
        got, want = outputs[name].outputs[0], reference[name].outputs[0]
        assert (got.finish_reason, got.token_ids, got.text) == (want.finish_reason, want.token_ids, want.text), name
        for step, (g, w) in enumerate(zip(got.logprobs, want.logprobs)):
            assert g.keys() == w.keys() and all(abs(g[t] - w[t]) <= 1e-5 for t in g), (name, step)


def test_a_sampling_fault_fails_only_its_request(engine_checkpoint, greedy_oracle, monkeypatch, caplog):
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path, **OFFLINE)
    reference = serve(engine, bystanders(adapters), "ref-")
    real_sample = Sampler._sample

    def faulty_sample(self, logits, settings):
        tokens = real_sample(self, logits, settings)  # the seeded rows have drawn their numbers already
        if bool((settings.temperatures == VICTIM_TEMPERATURE).any()):
            raise InjectedFault("sampling broke on the victim's row")
        return tokens

    monkeypatch.setattr(Sampler, "_sample", faulty_sample)
    victim = SamplingParams(temperature=VICTIM_TEMPERATURE, max_tokens=5, ignore_eos=True)
    with caplog.at_level(logging.WARNING):
        outputs = serve(engine, {**bystanders(adapters), "victim": ([20, 21], victim, None)})
    failed = outputs["victim"].outputs[0]
    assert failed.finish_reason == "error" and isinstance(failed.error, InjectedFault) and failed.token_ids == []
    assert "'victim'" in caplog.text and "sampling broke" in caplog.text
    assert_same_tokens(outputs, reference, ["base", "r4", "seeded"])
    assert_exact(outputs["r4"], adapters["r4"][1], [5, 6, 7, 8], greedy_oracle)
    assert_idle(engine)


def test_a_detokenization_fault_fails_only_its_request(engine_checkpoint, greedy_oracle, monkeypatch):
    path, hf, adapters = engine_checkpoint
    engine = make_engine(path, **OFFLINE)
    reference = serve(engine, bystanders(adapters), "ref-")
    victim_model, victim_prompt = adapters["r16-mlp"][1], [40, 41, 42]
    victim_tokens = greedy_oracle(victim_model, victim_prompt, 5)[0]
    others = {t for output in reference.values() for t in output.outputs[0].token_ids}
    poison = next((t for t in victim_tokens[2:] if t not in others and t not in victim_tokens[:2]), None)
    assert poison is not None, "pick another victim prompt: no token of its own to fail on"
    real_decode = engine.tokenizer.decode

    def decode(token_ids):  # a tokenizer that cannot decode one token (as with holes in a vocabulary)
        if poison in token_ids:
            raise InjectedFault(f"cannot decode token {poison}")
        return real_decode(token_ids)

    monkeypatch.setattr(engine.tokenizer, "decode", decode)
    victim = ({"victim": (victim_prompt, GREEDY, LoRARequest("r16-mlp", adapters["r16-mlp"][0]))})
    outputs = serve(engine, {**bystanders(adapters), **victim})
    failed = outputs["victim"].outputs[0]
    assert failed.finish_reason == "error" and isinstance(failed.error, InjectedFault)
    cut = victim_tokens.index(poison)
    assert failed.token_ids == victim_tokens[:cut + 1]
    assert failed.text == real_decode(victim_tokens[:cut])  # the text decoded before the fault is kept
    assert_same_tokens(outputs, reference, ["base", "r4", "seeded"])
    assert_idle(engine)


def test_a_placeholder_fault_fails_only_its_request(engine_checkpoint, monkeypatch, tmp_path):
    path, hf, adapters = engine_checkpoint
    factories.save_prompt_adapter(hf, tmp_path / "soft", num_virtual_tokens=4, seed=1)
    factories.write_hub_cache(tmp_path / "hub", "org/soft", tmp_path / "soft", "ab" * 20)
    engine = make_engine(path, **OFFLINE, max_prompt_adapters=1, max_prompt_adapter_tokens=8)
    reference = serve(engine, bystanders(adapters), "ref-")
    gate, real_download = threading.Event(), huggingface_hub.snapshot_download

    def gated_download(repo_id, **kwargs):  # the victim's adapter loads only once the gate opens
        assert gate.wait(60), "gate never opened"
        return real_download(repo_id, **{**kwargs, "cache_dir": str(tmp_path / "hub"), "local_files_only": True})

    real_insert = Request.insert_virtual_tokens

    def faulty_insert(request, num_virtual_tokens):
        if request.request_id == "victim":
            raise InjectedFault("placeholders broke")
        return real_insert(request, num_virtual_tokens)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated_download)
    monkeypatch.setattr(Request, "insert_virtual_tokens", faulty_insert)
    for request_id, (prompt, params, lora) in bystanders(adapters).items():
        engine.add_request(request_id, prompt, params, lora_request=lora)
    engine.add_request("victim", [30, 31], GREEDY, prompt_adapter_request=PromptAdapterRequest("soft", "org/soft"))
    gate.set()  # inserted by a later step(), not by add_request
    outputs = run_to_completion(engine)
    failed = outputs["victim"].outputs[0]
    assert failed.finish_reason == "error" and isinstance(failed.error, InjectedFault) and failed.token_ids == []
    assert_same_tokens(outputs, reference, ["base", "r4", "seeded"])
    assert_idle(engine)


def test_a_huge_finite_lora_fails_its_request_and_others_stay_exact(engine_checkpoint, greedy_oracle, tmp_path):
    path, hf, adapters = engine_checkpoint
    factories.save_huge_lora(hf, tmp_path / "huge")
    huge = LoRARequest("huge", str(tmp_path / "huge"))
    engine = make_engine(path, **OFFLINE, max_loras=2)
    reference = serve(engine, bystanders(adapters), "ref-")
    for request_id, (prompt, params, lora) in bystanders(adapters).items():
        engine.add_request(request_id, prompt, params, lora_request=lora)
    engine.add_request("huge-prefill", [20, 21, 22], GREEDY, lora_request=huge)
    done = {o.request_id: o for o in engine.step() if o.finished}
    engine.add_request("huge-later", [23, 24], GREEDY, lora_request=huge)  # beside bystanders in decode
    done = run_to_completion(engine, done=done)
    for request_id in ("huge-prefill", "huge-later"):
        failed = done[request_id].outputs[0]
        assert failed.finish_reason == "error" and failed.token_ids == [], request_id  # not "length" with 0s
        assert isinstance(failed.error, NonFiniteLogitsError), request_id
    assert_same_tokens(done, reference, ["base", "r4", "seeded"])
    assert_exact(done["base"], hf, [12, 13], greedy_oracle)
    assert_exact(done["r4"], adapters["r4"][1], [5, 6, 7, 8], greedy_oracle)
    assert_idle(engine)
    # the failed requests' KV blocks (NaN inside) go to the next requests, which stay exact
    after = serve(engine, {"base-after": ([12, 13], GREEDY, None),
                           "r4-after": ([5, 6, 7, 8], GREEDY, LoRARequest("r4", adapters["r4"][0]))})
    assert_exact(after["base-after"], hf, [12, 13], greedy_oracle)
    assert_exact(after["r4-after"], adapters["r4"][1], [5, 6, 7, 8], greedy_oracle)


def _sample_rows(params, logits, seeds):
    sampler = Sampler(logits.shape[1], "cpu", seed=3)
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return sampler(logits, sampler.make_batch(params, generators))


def test_sampler_contains_non_finite_rows_and_rows_that_raise():
    vocab = 64
    logits = torch.randn(6, vocab) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=1.0, seed=1, logprobs=2),
              SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=5, top_p=0.8, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=0.7, top_p=0.9)]
    seeds = [None, 1, None, 2, None, 3]
    good = [0, 1, 3, 4]
    alone = _sample_rows([params[i] for i in good], logits[good], [seeds[i] for i in good])

    broken = logits.clone()
    broken[2, 7], broken[5, 0] = float("nan"), float("inf")
    out = _sample_rows(params, broken, seeds)
    assert [type(e) for e in out.errors] == [type(None), type(None), NonFiniteLogitsError, type(None), type(None),
                                             NonFiniteLogitsError]
    assert [out.token_ids[i] for i in good] == alone.token_ids
    assert [out.logprobs[i] for i in good] == alone.logprobs

    params[5] = SamplingParams(temperature=0.7)
    params[5].logprobs = "many"  # gets past validation and breaks the batch after the random draws
    out = _sample_rows(params, logits, seeds)
    assert out.errors[5] is not None and out.errors[:5] == [None] * 5
    assert [out.token_ids[i] for i in good] == alone.token_ids  # seeded rows rewound before the retry
    assert [out.logprobs[i] for i in good] == alone.logprobs


def test_generate_leaves_nothing_live_when_a_step_raises(engine_checkpoint, greedy_oracle, monkeypatch):
    path, hf, adapters = engine_checkpoint
    llm = LLM(path, device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_num_seqs=4, max_model_len=64,
              block_size=4)
    prompts, loras = [[5, 6, 7, 8], [12, 13], [9, 10]], [LoRARequest("r4", adapters["r4"][0]), None, None]
    real_execute, calls = llm.engine.runner.execute, []

    def execute(*args, **kwargs):  # the engine itself breaks (not one request): step() raises
        calls.append(1)
        if len(calls) == 2:
            raise InjectedFault("the device fell over")
        return real_execute(*args, **kwargs)

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    with pytest.raises(InjectedFault):
        llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    outputs = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)  # works again
    for output, prompt, model in zip(outputs, prompts, (adapters["r4"][1], hf, hf)):
        assert_exact(output, model, prompt, greedy_oracle)
    llm.close()
