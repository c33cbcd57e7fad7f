"""LLM.generate against PEFT, and the adapter API while serving: validation first, hot-load,
replace, remove-in-use, pin/list, prompt forms, seeds."""

import pytest

from adapters import AdapterError, LoRARequest
from lora_runner import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    path, _, _ = engine_checkpoint
    return LLM(path, device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_num_seqs=4,
               max_model_len=64, block_size=4)


def lora(adapters, name, as_name=None):
    return LoRARequest(as_name or name, adapters[name][0])


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_generate_mixed_adapters_in_input_order(llm, engine_checkpoint, greedy_oracle):
    _, hf, adapters = engine_checkpoint
    prompts = [[5, 6, 7], [30, 31], [40, 41, 42, 43, 44, 45, 46], [9], [77, 78, 79]]
    names = ["r4", None, "r16-patterns", "r8-rslora", "r4"]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), GREEDY, GREEDY]
    outs = llm.generate(prompts, params, lora_request=[lora(adapters, n) if n else None for n in names],
                        use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for out, prompt, name, p in zip(outs, prompts, names, params):
        model = adapters[name][1] if name else hf
        assert out.finished and out.outputs[0].token_ids == greedy_oracle(model, prompt, p.max_tokens)[0]
    single = llm.generate(prompts[:2], GREEDY, lora_request=lora(adapters, "r8-qv"), use_tqdm=False)
    for out, prompt in zip(single, prompts):
        assert out.outputs[0].token_ids == greedy_oracle(adapters["r8-qv"][1], prompt, 4)[0]
    assert_idle(llm)


def test_prompt_forms_and_misaligned_lists(llm, engine_checkpoint):
    _, _, adapters = engine_checkpoint
    one = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    text = llm.generate("the cat sat", GREEDY, use_tqdm=False)
    mixed = llm.generate(["the cat sat", [5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(one) == len(text) == 1 and len(mixed) == 2
    assert mixed[1].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert mixed[0].outputs[0].token_ids == text[0].outputs[0].token_ids and mixed[0].prompt == "the cat sat"
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request has 3 entries"):
        llm.generate([[5], [6]], GREEDY, lora_request=[None] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate([], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):  # validated before anything runs
        llm.generate([[5], list(range(3, 100))], GREEDY, use_tqdm=False)
    assert_idle(llm)


def test_bad_adapter_raises_before_any_work(llm, engine_checkpoint, tmp_path, monkeypatch):
    _, _, adapters = engine_checkpoint
    added = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(a))
    with pytest.raises(AdapterError, match="broken"):
        llm.generate([[5], [6]], GREEDY, lora_request=[lora(adapters, "r4"), LoRARequest("broken", str(tmp_path))],
                     use_tqdm=False)
    assert added == []
    assert_idle(llm)


def test_seeded_sampling_reproduces(llm):
    params = SamplingParams(temperature=0.9, top_k=50, seed=11, max_tokens=8, ignore_eos=True)
    first = llm.generate([[5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batched = llm.generate([[9, 9, 9], [5, 6]], [other, params], use_tqdm=False)[1].outputs[0].token_ids
    assert batched == first


def run_engine(engine, until, outputs):
    while engine.has_unfinished_requests() and not until():
        outputs.update({o.request_id: o for o in engine.step()})


def test_hot_load_replace_and_remove_while_serving(llm, engine_checkpoint, greedy_oracle):
    _, _, adapters = engine_checkpoint
    engine, outputs = llm.engine, {}
    long = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # "tenant" starts as r4; a request runs on it
    llm.add_lora(lora(adapters, "r4", "tenant"))
    engine.add_request("old", [5, 6, 7], long, lora_request=lora(adapters, "r4", "tenant"))
    engine.add_request("mlp", [8, 9], long, lora_request=lora(adapters, "r16-mlp"))
    run_engine(engine, lambda: "old" in outputs and len(outputs["old"].outputs[0].token_ids) >= 3, outputs)
    assert not outputs["old"].finished
    # hot-load a new adapter and replace "tenant" with r8-rslora's weights while "old" is mid-decode
    llm.add_lora(lora(adapters, "r8-qv", "late"))
    llm.add_lora(lora(adapters, "r8-rslora", "tenant"))
    # remove an adapter in use: deferred, "mlp" keeps its weights
    llm.remove_lora("r16-mlp")
    assert "r16-mlp" not in llm.list_loras()
    engine.add_request("late", [10, 11], GREEDY, lora_request=lora(adapters, "r8-qv", "late"))
    engine.add_request("new", [5, 6, 7], GREEDY, lora_request=lora(adapters, "r8-rslora", "tenant"))
    run_engine(engine, lambda: False, outputs)
    assert outputs["old"].outputs[0].token_ids == greedy_oracle(adapters["r4"][1], [5, 6, 7], 10)[0]
    assert outputs["mlp"].outputs[0].token_ids == greedy_oracle(adapters["r16-mlp"][1], [8, 9], 10)[0]
    assert outputs["late"].outputs[0].token_ids == greedy_oracle(adapters["r8-qv"][1], [10, 11], 4)[0]
    assert outputs["new"].outputs[0].token_ids == greedy_oracle(adapters["r8-rslora"][1], [5, 6, 7], 4)[0]
    assert "tenant" in llm.list_loras() and "late" in llm.list_loras()
    llm.pin_lora("late")
    assert_idle(llm)


def test_unpin_and_close(engine_checkpoint):
    path, _, adapters = engine_checkpoint
    llm = LLM(path, device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=2, max_num_seqs=2,
              max_model_len=32, block_size=4)  # max_loras=2: at most max_loras - 1 pins
    llm.add_lora(lora(adapters, "r4"))
    llm.pin_lora("r4")
    llm.unpin_lora("r4")
    with pytest.raises(AdapterError):
        llm.unpin_lora("never-added")
    out = llm.generate([[5, 6]], GREEDY, lora_request=lora(adapters, "r4"), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.close()
    llm.close()  # idempotent
    # after close, a new adapter cannot be loaded in the background
    with pytest.raises(RuntimeError):
        llm.engine.add_request("late", [5, 6], GREEDY, lora_request=lora(adapters, "r8-qv"))
