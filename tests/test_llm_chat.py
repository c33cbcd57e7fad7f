"""LLM.chat against transformers (apply_chat_template + greedy generate) and PEFT, and the
tokenizer-output prompt forms of LLM.generate (BatchEncoding, dicts, 1-D tensors)."""

import pytest
import torch

from adapters import LoRARequest
from lora_runner import LLM, SamplingParams

MAX_TOKENS = 6
CONVERSATIONS = [
    [{"role": "user", "content": "hello who are you"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me a story"},
     {"role": "assistant", "content": "the cat sat on the mat"}, {"role": "user", "content": "what is the dog"}],
]


@pytest.fixture(scope="module")
def chat_checkpoint(tmp_path_factory):
    """(model dir, transformers model, tokenizer, LoRA dir, PeftModel): a tiny Llama whose tokenizer
    adds BOS when encoding and has a chat template that writes BOS itself."""
    from factories import save_lora, save_tiny_chat_tokenizer, save_tiny_model
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    hf = save_tiny_model(root / "model", "llama", seed=3, tokenizer=False)
    save_tiny_chat_tokenizer(root / "model")
    peft = save_lora(hf, root / "lora", seed=7, r=8, lora_alpha=16, scale=0.15)
    return str(root / "model"), hf, AutoTokenizer.from_pretrained(str(root / "model")), str(root / "lora"), peft


@pytest.fixture(scope="module")
def llm(chat_checkpoint):
    return LLM(chat_checkpoint[0], device="cpu", max_loras=2, max_lora_rank=8, max_num_seqs=4,
               max_model_len=96, block_size=4, max_logprobs=2)


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int]) -> list[int]:
    """transformers' greedy generate, stopped at EOS (kept) like the engine."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=0)
    tokens = out[0, len(prompt_ids):].tolist()
    return tokens[:tokens.index(2) + 1] if 2 in tokens else tokens


def test_chat_matches_transformers_template_and_greedy(llm, chat_checkpoint, greedy_oracle):
    _, hf, tokenizer, lora_dir, peft = chat_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1)
    outs = llm.chat(CONVERSATIONS, params, lora_request=[None, LoRARequest("tenant", lora_dir)], use_tqdm=False)
    assert len(outs) == len(CONVERSATIONS)
    for out, conversation, model in zip(outs, CONVERSATIONS, (hf, peft)):
        want = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert out.prompt_token_ids == want
        assert want.count(tokenizer.bos_token_id) == 1 and want[0] == tokenizer.bos_token_id  # no second BOS
        tokens = out.outputs[0].token_ids
        assert tokens == hf_greedy(model, want)
        oracle_tokens, oracle_logprobs = greedy_oracle(model, want, len(tokens))
        assert tokens == oracle_tokens
        got = [step[token] for step, token in zip(out.outputs[0].logprobs, tokens)]
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), torch.tensor(oracle_logprobs, dtype=torch.float64),
                                   atol=2e-4, rtol=1e-4)
    # one conversation (not a list of them) gives one output, the same as in the batch
    single = llm.chat(CONVERSATIONS[0], params, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert_idle(llm)


def test_chat_template_options(llm, chat_checkpoint):
    _, _, tokenizer, _, _ = chat_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    conversation = CONVERSATIONS[1]
    no_prompt = llm.chat(conversation, params, add_generation_prompt=False, use_tqdm=False)[0]
    assert no_prompt.prompt_token_ids == tokenizer.apply_chat_template(conversation)["input_ids"]
    other = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # no BOS: transformers adds none either
    custom = llm.chat(conversation, params, chat_template=other, use_tqdm=False)[0]
    assert custom.prompt_token_ids == tokenizer.apply_chat_template(conversation, chat_template=other)["input_ids"]
    assert tokenizer.bos_token_id not in custom.prompt_token_ids
    continued = llm.chat(conversation[:3], params, add_generation_prompt=False, continue_final_message=True,
                         use_tqdm=False)[0]
    assert continued.prompt_token_ids == tokenizer.apply_chat_template(
        conversation[:3], continue_final_message=True)["input_ids"]
    assert_idle(llm)


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    (["hello"], "must be a dict"),
    ([{"content": "hi"}], "'role'"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "user", "content": 5}], "'content' must be"),
    ([[{"role": "user", "content": "hi"}], []], "conversation 1"),
    ([{"role": "robot", "content": "hi"}], "could not render.*unknown role robot"),
])
def test_chat_rejects_malformed_messages(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)
    assert_idle(llm)


def test_chat_without_template(chat_checkpoint, tmp_path):
    from factories import save_tiny_chat_tokenizer

    _, hf, tokenizer, _, _ = chat_checkpoint
    hf.save_pretrained(str(tmp_path))
    save_tiny_chat_tokenizer(tmp_path, chat_template=None)
    llm = LLM(str(tmp_path), device="cpu", max_num_seqs=2, max_model_len=64, block_size=4)
    with pytest.raises(ValueError, match="no chat template: pass chat_template"):
        llm.chat(CONVERSATIONS[0], use_tqdm=False)
    out = llm.chat(CONVERSATIONS[0], SamplingParams(max_tokens=1), chat_template="{{ messages[0]['content'] }}",
                   use_tqdm=False)[0]
    assert out.prompt_token_ids == tokenizer.encode("hello who are you", add_special_tokens=False)
    llm.close()


def test_generate_accepts_tokenizer_outputs_and_tensors(llm, chat_checkpoint):
    _, _, tokenizer, _, _ = chat_checkpoint
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    texts = ["hello world", "the cat sat on the mat", "who"]
    want = [o.outputs[0].token_ids for o in llm.generate(texts, params, use_tqdm=False)]
    prompt_ids = [tokenizer.encode(t) for t in texts]
    for side in ("left", "right"):
        tokenizer.padding_side = side
        batch = tokenizer(texts, padding=True, return_tensors="pt")  # a BatchEncoding, padded [3, L]
        outs = llm.generate(batch, params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == prompt_ids
        assert [o.outputs[0].token_ids for o in outs] == want
    as_dict = llm.generate({"input_ids": prompt_ids[1]}, params, use_tqdm=False)  # one prompt's ids
    tensors = llm.generate([torch.tensor(p) for p in prompt_ids], params, use_tqdm=False)
    one_tensor = llm.generate(torch.tensor(prompt_ids[2], dtype=torch.int32), params, use_tqdm=False)
    chat = tokenizer.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, return_tensors="pt")
    from_chat = llm.generate(chat, params, use_tqdm=False)  # transformers 5: a BatchEncoding of [1, L]
    assert as_dict[0].outputs[0].token_ids == want[1]
    assert [o.outputs[0].token_ids for o in tensors] == want
    assert one_tensor[0].prompt_token_ids == prompt_ids[2] and one_tensor[0].outputs[0].token_ids == want[2]
    assert from_chat[0].prompt_token_ids == chat["input_ids"][0].tolist()
    assert_idle(llm)


@pytest.mark.parametrize("prompts, match", [
    (torch.tensor([[5, 6, 7]]), "must be 1-D"),
    (torch.tensor([5.0, 6.0]), "integer token ids"),
    (torch.tensor([True, False]), "integer token ids"),
    ([torch.tensor(5)], "must be 1-D"),
    ({"attention_mask": [1, 1]}, "must hold 'input_ids'"),
    ({"input_ids": torch.tensor([[5.0]])}, "must hold integers"),
    ({"input_ids": [[5, 6], [7, 8]], "attention_mask": [[1, 1]]}, "shape of input_ids"),
    ({"input_ids": "hello"}, "list of ints"),
])
def test_generate_rejects_bad_tensor_prompts(llm, prompts, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, use_tqdm=False)
    assert_idle(llm)
