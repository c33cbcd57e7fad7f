"""Prompt adapters (PEFT prompt tuning) end to end against PEFT: mixed batches with different soft
prompts, none, and a soft prompt together with a LoRA; chunked prefill across the soft prompt,
preemption (the soft prompt is re-applied on recompute), the per-step slot limit, the LLM API.

Oracles: PEFT prompt tuning's forward() (its logits rows after the n virtual ones are the prompt's)
and greedy decoding by repeated full forwards, not PEFT generate(). With a LoRA as well: the base
model with the LoRA loaded through PEFT, run on inputs_embeds = [soft prompt; token embeddings].
"""

import copy
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

import adapters.manager
from adapters import AdapterError, AdapterTooLargeError, InvalidAdapterError, LoRARequest, PromptAdapterRequest
from factories import build_tiny_model, edit_adapter_tensors, save_prompt_adapter
from lora_runner import LLM, SamplingParams

from engine_support import assert_exact, make_engine, run_to_completion

VOCAB = 256
SOFT_PROMPTS = {"pa4": dict(num_virtual_tokens=4, seed=11), "pa7": dict(num_virtual_tokens=7, seed=12)}
MAX_PROMPT_TOKENS = 8


class SoftPromptOnLoRA:
    """Oracle for a soft prompt with a LoRA: model(ids) -> .logits of [soft prompt; embed(ids)] through
    the base model with the LoRA loaded by PEFT (the rows after the virtual ones are the prompt's)."""

    def __init__(self, base, lora_dir, soft_prompt):
        self.model = PeftModel.from_pretrained(copy.deepcopy(base), lora_dir).eval()
        self.soft_prompt = soft_prompt  # [n, hidden]

    def __call__(self, input_ids):  # input_ids [1, L]
        embeds = self.model.get_input_embeddings()(input_ids)  # [1, L, hidden]
        embeds = torch.cat((self.soft_prompt[None], embeds), dim=1)  # [1, n + L, hidden]
        return SimpleNamespace(logits=self.model(inputs_embeds=embeds).logits)


@pytest.fixture(scope="module")
def soft(engine_checkpoint, tmp_path_factory):
    """Saved prompt adapters and oracles: name or (soft prompt, LoRA) -> model(ids).logits."""
    path, hf, loras = engine_checkpoint
    root = tmp_path_factory.mktemp("prompt-adapters")
    dirs, oracles = {}, {None: hf}
    for name, kwargs in SOFT_PROMPTS.items():
        dirs[name] = str(root / name)
        oracles[name] = save_prompt_adapter(hf, root / name, **kwargs)
    for lora in loras:
        oracles[(None, lora)] = loras[lora][1]
    for name, lora in (("pa4", "r4"), ("pa7", "r4"), ("pa7", "r16-mlp"), ("pa4", "r8-qv")):
        embeddings = load_file(f"{dirs[name]}/adapter_model.safetensors")["prompt_embeddings"]
        oracles[(name, lora)] = SoftPromptOnLoRA(hf, loras[lora][0], embeddings)
    return SimpleNamespace(path=path, hf=hf, loras=loras, dirs=dirs, oracles=oracles, root=root)


def requests_for(soft, name, lora):
    pa = PromptAdapterRequest(name, soft.dirs[name]) if name else None
    return pa, (LoRARequest(lora, soft.loras[lora][0]) if lora else None)


def oracle_model(soft, name, lora):
    return soft.oracles[(name, lora) if lora else name]


# 6 rows, 2 soft-prompt slots; max_cpu_loras=None: EngineConfig's own default; a stale or unwritten
# read shows as NaN: the whole KV cache and every soft-prompt slot row are poisoned
ENGINE = dict(max_num_seqs=6, max_model_len=48, max_cpu_loras=None, max_prompt_adapters=2,
              max_prompt_adapter_tokens=MAX_PROMPT_TOKENS, poison=("kv_cache", "prompt_slots"))


def random_prompts(n, seed, lo=2, hi=9):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def assert_idle(engine):
    """No KV block is held and no request holds an adapter: removing them all frees them at once."""
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    for name in engine.list_loras():
        engine.remove_lora(name)
    for name in engine.list_prompt_adapters():
        engine.remove_prompt_adapter(name)
    for tier in (engine.adapters.manager.loras, engine.adapters.manager.prompts):
        stats = tier.memory_stats()
        assert (stats["num_cpu"], stats["num_resident"]) == (0, 0), (tier.kind, stats)


MIXED = [("pa4", None), ("pa7", None), (None, None), ("pa4", "r4"), (None, "r8-qv"), ("pa7", "r4")]


def test_mixed_batch_first_step_logits_and_greedy_match_peft(soft, greedy_oracle):
    engine = make_engine(soft.path, **(ENGINE | dict(max_num_batched_tokens=128)))
    for name in SOFT_PROMPTS:  # loaded now, so every request is admitted in the first step
        engine.add_prompt_adapter(PromptAdapterRequest(name, soft.dirs[name]))
    for lora in ("r4", "r8-qv"):
        engine.add_lora(LoRARequest(lora, soft.loras[lora][0]))
    prompts = random_prompts(len(MIXED), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for i, ((name, lora), prompt) in enumerate(zip(MIXED, prompts)):
        pa, lora_request = requests_for(soft, name, lora)
        engine.add_request(f"m{i}", prompt, params, lora_request=lora_request, prompt_adapter_request=pa)
    captured = []
    model = engine.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute_logits(hidden)) or captured[-1]
    first = engine.step()
    assert [o.request_id for o in first] == [f"m{i}" for i in range(len(MIXED))]  # rows in sampling order
    logits = captured[0]  # [6, vocab]
    with torch.inference_mode():
        for row, ((name, lora), prompt) in enumerate(zip(MIXED, prompts)):
            want = oracle_model(soft, name, lora)(torch.tensor([prompt])).logits[0, -1]  # [vocab]
            assert (logits[row] - want).abs().max() <= 1e-4, (name, lora)
    done = run_to_completion(engine, done={o.request_id: o for o in first if o.finished})
    for i, ((name, lora), prompt) in enumerate(zip(MIXED, prompts)):
        assert_exact(done[f"m{i}"], oracle_model(soft, name, lora), prompt, greedy_oracle, 6)
        assert len(done[f"m{i}"].outputs[0].token_ids) == 6
    # the soft prompts matter: a dropped or misplaced soft prompt would show
    for name, prompt in zip(["pa4", "pa7"], prompts):
        assert greedy_oracle(soft.oracles[name], prompt, 6)[0] != greedy_oracle(soft.hf, prompt, 6)[0]
    combined, lora_only = soft.oracles[("pa4", "r4")], soft.oracles[(None, "r4")]
    assert greedy_oracle(combined, prompts[3], 6)[0] != greedy_oracle(lora_only, prompts[3], 6)[0]
    assert_idle(engine)


def test_chunked_prefill_preemption_and_slot_limit(soft, greedy_oracle):
    # 8 tokens per step cut the soft prompt and the prompt into chunks; 12 blocks of 4 tokens cannot
    # hold several requests of up to 26 tokens, so some are preempted and recompute their soft
    # prompt; one soft-prompt slot: a step never maps two prompt adapters.
    engine = make_engine(soft.path, **(ENGINE | dict(max_num_batched_tokens=8, max_prompt_adapters=1,
                                                    kv_cache_memory_bytes=12 * 2048)))
    assert engine.block_manager.num_blocks == 12
    cases = [("pa7", None), ("pa4", None), (None, None), ("pa4", "r4"), ("pa7", None), ("pa7", "r16-mlp"),
             ("pa4", None), (None, "r4")]
    prompts = random_prompts(len(cases), seed=0, lo=3, hi=14)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    upload, steps_slots = engine.runner.batch_builder.upload, []

    def recording_upload(step, padded_seqs=None):
        batch = upload(step, padded_seqs)
        if batch.has_prompt_adapter:
            slots = batch.token_prompt_slots
            steps_slots.append(set(slots[slots >= 0].tolist()))
        return batch

    engine.runner.batch_builder.upload = recording_upload
    requests = []
    for i, ((name, lora), prompt) in enumerate(zip(cases, prompts)):
        pa, lora_request = requests_for(soft, name, lora)
        requests.append((f"c{i}", prompt, params, lora_request, pa))
    for _, _, _, lora_request, pa in requests:  # in the CPU cache before the first step: which requests
        if lora_request is not None:            # run together (and are preempted) must not depend on
            engine.add_lora(lora_request)       # how fast a background load is on a loaded machine
        if pa is not None:
            engine.add_prompt_adapter(pa)
    preempted_with_soft_prompt = set()

    def record_preempted(step, outputs):
        preempted_with_soft_prompt.update(r.request_id for r in engine.scheduler.waiting
                                          if r.num_preemptions and r.prompt_adapter_request is not None)

    done = run_to_completion(engine, requests, per_step=3, on_step=record_preempted)
    assert preempted_with_soft_prompt and steps_slots and max(len(s) for s in steps_slots) == 1
    assert engine.adapters.manager.stats.prompt_evictions > 0  # one slot, two adapters: slot re-written
    for i, ((name, lora), prompt) in enumerate(zip(cases, prompts)):
        assert_exact(done[f"c{i}"], oracle_model(soft, name, lora), prompt, greedy_oracle, 5)
    assert_idle(engine)


def test_max_model_len_counts_virtual_tokens(soft, greedy_oracle, monkeypatch):
    engine = make_engine(soft.path, **(ENGINE | dict(max_model_len=16)))
    gate, load = threading.Event(), adapters.manager.load_prompt_adapter
    monkeypatch.setattr(adapters.manager, "load_prompt_adapter", lambda *a, **k: gate.wait(60) and load(*a, **k))
    pa7 = PromptAdapterRequest("pa7", soft.dirs["pa7"])
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("late", list(range(3, 13)), long, prompt_adapter_request=pa7)  # 7 + 10 > 16, not known yet
    engine.add_request("base", [5, 6], long)
    for _ in range(2):  # the base request runs while the soft prompt loads
        assert [o.request_id for o in engine.step()] == ["base"]
    gate.set()
    engine.add_prompt_adapter(pa7)  # waits for the background load
    with pytest.raises(ValueError, match="7 virtual tokens to a 10-token prompt, more than max_model_len=16"):
        engine.add_request("known", list(range(3, 13)), long, prompt_adapter_request=pa7)
    engine.add_request("fits", [5, 6, 7, 8, 9, 10, 11], long, prompt_adapter_request=pa7)  # 7 + 7 + 2 outputs
    done = run_to_completion(engine)
    late = done["late"]
    assert late.outputs[0].finish_reason == "error" and isinstance(late.error, ValueError)
    assert "more than max_model_len=16" in str(late.error) and late.outputs[0].token_ids == []
    fits = done["fits"].outputs[0]
    assert fits.finish_reason == "length" and len(fits.token_ids) == 2
    assert fits.token_ids == greedy_oracle(soft.oracles["pa7"], [5, 6, 7, 8, 9, 10, 11], 2)[0]
    assert done["base"].outputs[0].token_ids == greedy_oracle(soft.hf, [5, 6], 10)[0]
    assert_idle(engine)


def test_llm_generate_with_prompt_adapters_and_management(soft, greedy_oracle):
    llm = LLM(soft.path, device="cpu", max_loras=2, max_lora_rank=16, max_prompt_adapters=2,
              max_prompt_adapter_tokens=MAX_PROMPT_TOKENS, max_num_seqs=4, max_model_len=48, block_size=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompts = random_prompts(4, seed=3)
    names, loras = ["pa7", None, "pa4", "pa4"], [None, "r4", "r8-qv", None]
    outs = llm.generate(prompts, greedy, lora_request=[requests_for(soft, None, lora)[1] for lora in loras],
                        prompt_adapter_request=[requests_for(soft, n, None)[0] for n in names], use_tqdm=False)
    for out, prompt, name, lora in zip(outs, prompts, names, loras):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == greedy_oracle(oracle_model(soft, name, lora), prompt, 4)[0]
    one = llm.generate(prompts[:2], greedy, prompt_adapter_request=requests_for(soft, "pa7", None)[0],
                       use_tqdm=False)  # one soft prompt for all prompts
    for out, prompt in zip(one, prompts):
        assert out.outputs[0].token_ids == greedy_oracle(soft.oracles["pa7"], prompt, 4)[0]
    assert set(llm.list_prompt_adapters()) == {"pa4", "pa7"}
    llm.pin_prompt_adapter("pa4")
    engine = llm.engine
    engine.add_request("held", prompts[2], greedy, prompt_adapter_request=requests_for(soft, "pa7", None)[0])
    llm.remove_prompt_adapter("pa7")  # deferred: the queued request keeps the soft prompt it started with
    assert llm.list_prompt_adapters() == ["pa4"]
    done = run_to_completion(engine)
    assert done["held"].outputs[0].token_ids == greedy_oracle(soft.oracles["pa7"], prompts[2], 4)[0]
    assert engine.adapters.manager.prompts.memory_stats()["num_cpu"] == 1  # pa7 dropped once released
    with pytest.raises(ValueError, match="prompt_adapter_request has 1 entries for 2 prompts"):
        llm.generate(prompts[:2], greedy, prompt_adapter_request=[None], use_tqdm=False)
    with pytest.raises(ValueError, match="must be a PromptAdapterRequest"):
        llm.engine.add_request("x", [5], greedy, prompt_adapter_request=LoRARequest("r4", soft.loras["r4"][0]))
    no_slots = LLM(soft.path, device="cpu", max_num_seqs=2, max_model_len=32, block_size=4)
    with pytest.raises(ValueError, match="prompt adapters are disabled"):
        no_slots.generate([[5]], greedy, prompt_adapter_request=requests_for(soft, "pa4", None)[0], use_tqdm=False)
    assert_idle(llm.engine)
    assert_idle(no_slots.engine)


@pytest.fixture(scope="module")
def invalid(soft):
    """Invalid prompt adapters: name -> (request, AdapterError subclass, message fragment)."""
    root = soft.root
    save_prompt_adapter(soft.hf, root / "too-many", num_virtual_tokens=MAX_PROMPT_TOKENS + 1)
    other = build_tiny_model("llama", seed=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    save_prompt_adapter(other, root / "other-hidden", num_virtual_tokens=4)
    save_prompt_adapter(soft.hf, root / "no-key", num_virtual_tokens=4)
    edit_adapter_tensors(root / "no-key", lambda tensors: {})
    cases = {"too-many": (AdapterTooLargeError, "num_virtual_tokens=9 is over max_prompt_adapter_tokens=8"),
             "other-hidden": (InvalidAdapterError, "token_dim=32 does not match the base model's hidden size 64"),
             "no-key": (InvalidAdapterError, "missing key 'prompt_embeddings'")}
    return {name: (PromptAdapterRequest(name, str(root / name)), *case) for name, case in cases.items()}


def test_invalid_prompt_adapters_fail_only_their_requests(soft, invalid, greedy_oracle):
    engine = make_engine(soft.path, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = [("ok-pa4", "pa4", None, [5, 6, 7]), ("ok-base", None, None, [8, 9]), ("ok-both", "pa4", "r4", [10, 11])]
    for request_id, name, lora, prompt in good[:2]:
        pa, lora_request = requests_for(soft, name, lora)
        engine.add_request(request_id, prompt, greedy, lora_request=lora_request, prompt_adapter_request=pa)
    for name, (request, _, _) in invalid.items():
        engine.add_request(f"bad-{name}", [5, 6], greedy, prompt_adapter_request=request,
                           lora_request=LoRARequest("r4", soft.loras["r4"][0]))
    pa, lora_request = requests_for(soft, "pa4", "r4")
    engine.add_request("ok-both", [10, 11], greedy, lora_request=lora_request, prompt_adapter_request=pa)
    done = run_to_completion(engine)
    for name, (_, error, fragment) in invalid.items():
        out = done[f"bad-{name}"]
        assert out.outputs[0].finish_reason == "error" and isinstance(out.error, error), name
        assert fragment in str(out.error) and repr(name) in str(out.error) and out.outputs[0].token_ids == []
    for request_id, name, lora, prompt in good:
        assert done[request_id].outputs[0].token_ids == greedy_oracle(oracle_model(soft, name, lora), prompt, 4)[0]
    assert_idle(engine)  # the failed requests released their LoRA too


def test_generate_raises_on_invalid_prompt_adapter_before_any_work(soft, invalid, monkeypatch):
    llm = LLM(soft.path, device="cpu", max_prompt_adapters=1, max_prompt_adapter_tokens=MAX_PROMPT_TOKENS,
              max_num_seqs=2, max_model_len=32, block_size=4)
    added = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(a))
    for name, (request, error, fragment) in invalid.items():
        with pytest.raises(error, match=fragment) as info:
            llm.generate([[5], [6]], SamplingParams(max_tokens=2),
                         prompt_adapter_request=[requests_for(soft, "pa4", None)[0], request], use_tqdm=False)
        assert isinstance(info.value, AdapterError)
    assert added == [] and llm.list_prompt_adapters() == ["pa4"]
