"""Soft prompts in the model: placeholder tokens' embeddings replaced from prompt-adapter slots, vs PEFT."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from factories import save_prompt_adapter
from lora_runner.model.forward_context import PromptAdapterContext
from test_model_harness import PagedDriver, assert_close, hf_logits, make_checkpoint


def test_soft_prompt_rows_match_peft_prompt_tuning(tmp_path):
    ckpt = make_checkpoint(tmp_path / "base", "llama")
    num_virtual, max_tokens, hidden = 4, 6, ckpt.config.hidden_size
    peft_model = save_prompt_adapter(ckpt.hf, tmp_path / "pa", num_virtual_tokens=num_virtual, seed=3)
    soft_prompt = load_file(str(tmp_path / "pa" / "adapter_model.safetensors"))["prompt_embeddings"]
    embeddings = torch.full((2, max_tokens, hidden), float("nan"))  # unused rows must never be read
    embeddings[1, :num_virtual] = soft_prompt

    gen = torch.Generator().manual_seed(4)
    prompted, plain = torch.randint(3, 256, (5,), generator=gen), torch.randint(3, 256, (6,), generator=gen)
    with torch.no_grad():
        expected = peft_model(input_ids=prompted[None]).logits[0, -len(prompted):]
    # sequence 0: 4 placeholder tokens (id 0) + prompt; sequence 1: no prompt adapter
    seq0 = torch.cat((torch.zeros(num_virtual, dtype=torch.long), prompted))
    num_tokens = len(seq0) + len(plain)
    token_slots = torch.full((num_tokens,), -1)
    token_slots[:num_virtual] = 1
    token_positions = torch.full((num_tokens,), -1)
    token_positions[:num_virtual] = torch.arange(num_virtual)
    driver = PagedDriver(ckpt.model, ckpt.config)
    input_ids, positions, ctx = driver.context([(0, seq0), (1, plain)])
    ctx.prompt_adapter = PromptAdapterContext(embeddings, token_slots, token_positions)
    with torch.no_grad():
        logits = ckpt.model.compute_logits(ckpt.model(input_ids, positions, ctx))
    assert_close(logits[num_virtual:len(seq0)], expected, "prompted sequence")
    assert_close(logits[len(seq0):], hf_logits(ckpt.hf, plain), "sequence without soft prompt")
