"""vLLM's Python spellings through the real LLM (issue 38, item 4): LLM(model, enable_lora=True, ...),
LoRARequest(lora_name=, lora_int_id=, lora_path=), prompt dicts, get_tokenizer(),
SamplingParams(guided_decoding=...); the same request in two spellings gives the same tokens and
logprobs, and a vLLM option this engine lacks is one ValueError naming it. Also LLM.generate with a
constraint that does not compile: a ValueError before anything runs (item 5)."""

import pytest

from lora_runner import (LLM, EngineConfig, GuidedDecodingParams, LoRARequest, SamplingParams,
                         StructuredOutputsParams)
from lora_runner.engine.structured import StructuredOutputError
from lora_runner.entrypoints.vllm_compat import VLLM_OPTIONS, engine_kwargs, refusal

GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
OURS = dict(device="cpu", max_loras=2, max_lora_rank=16, max_cpu_loras=4, max_num_seqs=4, max_model_len=64,
            block_size=4)
VLLM_HABITS = dict(enable_lora=True, trust_remote_code=False, swap_space=4, disable_log_stats=True,
                   enable_chunked_prefill=True, tokenizer_mode="auto", kv_cache_dtype="auto", seed=0)


@pytest.fixture(scope="module")
def llm(engine_checkpoint):
    path, _, _ = engine_checkpoint
    llm = LLM(path, tokenizer=path, **VLLM_HABITS, **OURS)
    yield llm
    llm.close()


def _same(outputs, others):
    """Both lists give the same prompt ids, tokens and logprobs, in order."""
    assert [o.prompt_token_ids for o in outputs] == [o.prompt_token_ids for o in others]
    for out, other in zip(outputs, others):
        assert out.outputs[0].token_ids == other.outputs[0].token_ids
        assert out.outputs[0].logprobs == other.outputs[0].logprobs


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


def test_vllm_keywords_build_the_engine_our_keywords_build(llm, engine_checkpoint):
    path, _, _ = engine_checkpoint
    assert llm.engine.config == EngineConfig(model=path, seed=0, **OURS)
    renamed = engine_kwargs(path, {"enable_prompt_adapter": True, "max_prompt_adapter_token": 8})
    assert renamed == {"max_prompt_adapters": 1, "max_prompt_adapter_tokens": 8}
    assert engine_kwargs(path, {"enable_prompt_adapter": True, "max_prompt_adapters": 3}) == {"max_prompt_adapters": 3}
    with pytest.raises(ValueError, match="both max_prompt_adapter_token"):
        engine_kwargs(path, {"max_prompt_adapter_token": 8, "max_prompt_adapter_tokens": 8})


@pytest.mark.parametrize("name, value", [
    ("trust_remote_code", True), ("tokenizer", "org/another-tokenizer"), ("enable_chunked_prefill", False),
    ("pipeline_parallel_size", 2), ("kv_cache_dtype", "fp8"), ("lora_extra_vocab_size", 256),
    ("long_lora_scaling_factors", (4.0,)), ("download_dir", "/tmp/x"),
    ("cpu_offload_gb", 4), ("skip_tokenizer_init", True), ("tokenizer_revision", "v2"), ("lora_dtype", "float16"),
])
def test_a_vllm_option_this_engine_lacks_is_one_value_error_naming_it(engine_checkpoint, name, value):
    path, _, _ = engine_checkpoint
    reason = refusal(name, value)
    assert reason == VLLM_OPTIONS[name].reason
    with pytest.raises(ValueError) as error:
        LLM(path, device="cpu", **{name: value})
    assert str(error.value) == f"LLM({name}={value!r}) is not supported: {reason}"


def test_an_unknown_keyword_is_a_value_error_with_the_closest_names(engine_checkpoint):
    path, _, _ = engine_checkpoint
    with pytest.raises(ValueError, match=r"unknown keyword 'max_lora_ranks' \(did you mean max_lora_rank"):
        LLM(path, device="cpu", max_lora_ranks=8)
    with pytest.raises(ValueError, match="unknown keyword 'worker_cls'"):
        LLM(path, device="cpu", worker_cls="x")
    assert refusal("trust_remote_code", 1) is not None  # a bool option takes bools only
    assert refusal("cpu_offload_gb", 0.0) is None and refusal("enable_lora", False) is None


def test_lora_request_spellings_are_one_request_with_the_same_output(llm, engine_checkpoint, greedy_oracle):
    _, _, adapters = engine_checkpoint
    adapter_dir, peft = adapters["r4"]
    spellings = [LoRARequest("r4", adapter_dir), LoRARequest("r4", 1, adapter_dir),
                 LoRARequest(lora_name="r4", lora_int_id=7, lora_path=adapter_dir),
                 LoRARequest("r4", 2, lora_path=adapter_dir), LoRARequest(lora_name="r4", lora_local_path=adapter_dir,
                                                                          base_model_name="base")]
    assert len(set(spellings)) == 1
    prompts = [[5, 6, 7], [30, 31]]
    outputs = [llm.generate(prompts, SamplingParams(**GREEDY), lora_request=s, use_tqdm=False) for s in spellings]
    for other in outputs[1:]:
        _same(outputs[0], other)
    assert outputs[0][0].outputs[0].token_ids == greedy_oracle(peft, prompts[0], 4)[0]
    assert_idle(llm)


@pytest.mark.parametrize("args, kwargs, message", [
    (("r4", 1), {}, "needs the adapter's path"),  # the id is never taken for a path
    (("r4", 0, "/a"), {}, "must be >= 1"),
    (("r4", True, "/a"), {}, "path must be a non-empty string"),
    ((), {"lora_name": "r4", "lora_int_id": "1", "lora_path": "/a"}, "must be >= 1"),
    (("r4", 1, "/a"), {"lora_int_id": 2}, "integer id twice"),
    (("r4", "/a"), {"lora_path": "/b"}, "path twice"),
    (("r4", "/a"), {"lora_name": "r5"}, "name twice"),
    (("r4", 1, "/a"), {"long_lora_max_len": 4096}, r"long_lora_max_len=\.\.\.\) is not supported"),
])
def test_lora_request_spellings_that_cannot_be_one_request_are_value_errors(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoRARequest(*args, **kwargs)


def test_prompt_dicts_are_the_same_prompts(llm):
    params = SamplingParams(**GREEDY)
    plain = llm.generate(["the cat sat", [5, 6, 7]], params, use_tqdm=False)
    dicts = llm.generate([{"prompt": "the cat sat"}, {"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    _same(plain, dicts)
    assert dicts[0].prompt == "the cat sat"
    _same(plain[1:], llm.generate({"prompt_token_ids": [5, 6, 7], "prompt": "a label"}, params, use_tqdm=False))
    _same(plain[:1], llm.generate({"prompt": "the cat sat", "multi_modal_data": None}, params, use_tqdm=False))
    assert llm.get_tokenizer().encode("the cat sat") == plain[0].prompt_token_ids


def test_a_prompt_dicts_cache_salt_is_that_prompts(llm):
    prompt = [9 + i for i in range(12)]  # three full blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate([prompt], params, use_tqdm=False)  # unsalted: its blocks are cached
    first, again = (llm.generate([{"prompt_token_ids": prompt, "cache_salt": "t1"}], params, use_tqdm=False)[0]
                    for _ in range(2))
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 8)  # salted apart from the unsalted run
    same = llm.generate([{"prompt_token_ids": prompt, "cache_salt": "t1"}], params, cache_salt="t1", use_tqdm=False)
    assert same[0].num_cached_tokens == 8
    with pytest.raises(ValueError, match="prompt 0: its dict's cache_salt 't1' differs"):
        llm.generate([{"prompt_token_ids": prompt, "cache_salt": "t1"}], params, cache_salt="t2", use_tqdm=False)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "describe", "multi_modal_data": {"image": object()}}, "prompt 1: multi_modal_data is not supported"),
    ({"prompt_embeds": [[0.0]]}, "prompt 1: prompt_embeds is not supported"),
    ({"prompt": "x", "lora": "r4"}, "prompt 1: unknown key 'lora'"),
    ({"prompt": 5}, "prompt 1: a prompt dict needs 'prompt'"),
])
def test_prompt_dicts_this_engine_cannot_serve_are_refused_before_anything_runs(llm, monkeypatch, prompt, message):
    added = []
    monkeypatch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(a))
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt": "fine"}, prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert added == []


CONSTRAINTS = [dict(choice=["yes", "no way"]), dict(regex=r"[a-c]{2,4}"), dict(json={"type": "object", "properties":
               {"a": {"type": "integer"}}, "required": ["a"]})]


@pytest.mark.parametrize("constraint", CONSTRAINTS)
def test_guided_decoding_is_structured_outputs(llm, constraint):
    greedy = dict(temperature=0.0, max_tokens=12, logprobs=2)
    ours = llm.generate(["pick"], SamplingParams(structured_outputs=StructuredOutputsParams(**constraint), **greedy),
                        use_tqdm=False)
    backend = llm.engine.structured.compiler.backend.name  # the server's own (another: test_vllm_structured_spellings)
    for guided in (GuidedDecodingParams(**constraint, backend=backend, disable_fallback=True), constraint):
        theirs = llm.generate(["pick"], SamplingParams(guided_decoding=guided, **greedy), use_tqdm=False)
        _same(ours, theirs)
    if "choice" in constraint:
        assert ours[0].outputs[0].text in constraint["choice"] and ours[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, message", [
    (dict(guided_decoding=dict(regex="a", whitespace_pattern=" ")), "guided_decoding.whitespace_pattern"),
    (dict(guided_decoding=dict(regex="a", backend="outlines")), "guided_decoding.backend='outlines'"),
    (dict(guided_decoding=dict(structural_tag="{}")), "structural_tag"),
    (dict(guided_decoding=dict(regex="a", lark="x")), r"unknown fields \['lark'\]"),
    (dict(guided_decoding=dict(regex="a"), structured_outputs=StructuredOutputsParams(regex="a")), "not both"),
    (dict(guided_decoding="a+"), "guided_decoding must be"),
])
def test_guided_decoding_fields_without_a_counterpart_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("bad", [StructuredOutputsParams(regex="(unclosed"),
                                 StructuredOutputsParams(grammar="root ::= missing_rule"),
                                 StructuredOutputsParams(json={"type": "nope"})])
def test_a_constraint_that_does_not_compile_raises_before_anything_runs(llm, monkeypatch, bad):
    fine = SamplingParams(temperature=0.0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    with monkeypatch.context() as patch:
        added = []
        patch.setattr(llm.engine, "add_request", lambda *a, **k: added.append(a))
        with pytest.raises(ValueError, match="prompt 2: .*cannot be compiled") as error:  # vLLM's exception
            llm.generate([[5], [6], [7], [8]], [plain, fine, SamplingParams(structured_outputs=bad), plain],
                         use_tqdm=False)
        assert type(error.value) is StructuredOutputError and added == []
    with pytest.raises(ValueError, match="prompt 0: .*cannot be compiled"):  # vLLM's spelling of it
        llm.generate(["hi"], SamplingParams(guided_decoding={bad.kind: getattr(bad, bad.kind)}), use_tqdm=False)
    assert_idle(llm)
    done = llm.generate([[5], [6]], [plain, fine], use_tqdm=False)  # the others still run, the engine serves on
    assert [o.outputs[0].finish_reason for o in done] == ["length", "length"]
    assert set("".join(done[1].outputs[0].text.split())) <= set("ab")  # this tokenizer decodes with spaces


def test_vllm_sampling_options_that_ask_for_nothing_pass_and_the_rest_are_named(llm):
    params = SamplingParams(**GREEDY)
    _same(llm.generate([[5, 6, 7]], params, use_tqdm=False),
          llm.generate([[5, 6, 7]], SamplingParams(**GREEDY, best_of=1, detokenize=True, logits_processors=None,
                                                   extra_args=None), use_tqdm=False))
    for name, value in (("best_of", 2), ("logits_processors", [lambda ids, logits: logits]), ("extra_args", {"k": 1}),
                        ("best_of", True)):
        with pytest.raises(ValueError, match=rf"SamplingParams\({name}=.*\) is not supported"):
            SamplingParams(**{name: value})


def test_vllms_quantization_names_of_a_quantized_checkpoint_say_it_is_detected(engine_checkpoint):
    path, _, _ = engine_checkpoint
    with pytest.raises(ValueError, match="got 'awq' .*detected from its config.json: leave quantization None"):
        LLM(path, device="cpu", quantization="awq")
