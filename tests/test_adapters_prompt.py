"""PEFT prompt-tuning parsing: the soft prompt equals PEFT's; refused and broken checkpoints raise."""

import pytest
import torch

from adapters import (
    AdapterTooLargeError,
    InvalidAdapterError,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from adapters.lora import load_lora
from adapters.prompt import dummy_prompt_adapter, load_prompt_adapter
from adapters.slots import PromptSlots
from tests import factories


@pytest.fixture(scope="module")
def base():
    return factories.build_tiny_model("llama", seed=3)


@pytest.mark.parametrize("num_virtual_tokens,dtype", [(1, torch.float32), (6, torch.float32), (8, torch.float16)])
def test_soft_prompt_equals_peft(base, tmp_path, num_virtual_tokens, dtype):
    peft_model = factories.save_prompt_adapter(base, tmp_path, num_virtual_tokens=num_virtual_tokens,
                                               seed=num_virtual_tokens)
    weights = load_prompt_adapter("p", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8,
                                  dtype=dtype)
    with torch.no_grad():
        expected = peft_model.get_prompt(batch_size=1)[0]  # [num_virtual_tokens, hidden]
    assert weights.num_virtual_tokens == num_virtual_tokens and weights.embeddings.dtype == dtype
    torch.testing.assert_close(weights.embeddings.float(), expected.float(), rtol=1e-3, atol=1e-3)


def test_slots_zero_what_a_longer_prompt_left(base, tmp_path):
    spec = factories.model_spec(base)
    slots = PromptSlots(spec, max_prompt_adapters=2, max_prompt_adapter_tokens=8)
    slots.embeddings.fill_(float("nan"))
    long, short = dummy_prompt_adapter("long", spec, 8, seed=1), dummy_prompt_adapter("short", spec, 3, seed=2)
    slots.write(1, long)
    slots.write(1, short)
    assert torch.equal(slots.embeddings[1, :3], short.embeddings)
    assert torch.all(slots.embeddings[1, 3:] == 0)
    assert torch.isnan(slots.embeddings[0]).all()  # other slots untouched
    assert slots.num_virtual_tokens.tolist() == [0, 3]
    slots.clear(1)
    assert slots.num_virtual_tokens.tolist() == [0, 0]


def test_too_many_virtual_tokens(base, tmp_path):
    factories.save_prompt_adapter(base, tmp_path, num_virtual_tokens=9)
    with pytest.raises(AdapterTooLargeError, match="max_prompt_adapter_tokens=8"):
        load_prompt_adapter("p", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8)


def test_other_hidden_size_is_invalid(base, tmp_path):
    other = factories.build_tiny_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    factories.save_prompt_adapter(other, tmp_path)
    with pytest.raises(InvalidAdapterError, match="hidden size 64"):
        load_prompt_adapter("p", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8)


def test_kinds_are_not_interchangeable(base, tmp_path):
    spec = factories.model_spec(base)
    factories.save_prompt_adapter(base, tmp_path / "prompt")
    factories.save_lora(base, tmp_path / "lora", r=2)
    with pytest.raises(UnsupportedAdapterError, match="peft_type='PROMPT_TUNING'"):
        load_lora("p", str(tmp_path / "prompt"), spec, max_lora_rank=8)
    with pytest.raises(UnsupportedAdapterError, match="peft_type='LORA'"):
        load_prompt_adapter("l", str(tmp_path / "lora"), spec, max_prompt_adapter_tokens=8)


@pytest.mark.parametrize("edit,fragment", [
    (lambda t: {"prompt_embeddings": torch.full_like(t["prompt_embeddings"], float("nan"))}, "NaN"),
    (lambda t: {"prompt_embeddings": t["prompt_embeddings"][:3]}, "shape"),
    (lambda t: {**t, "extra": torch.zeros(2)}, "unexpected key"),
    (lambda t: {}, "missing key"),
])
def test_broken_embeddings_are_invalid(base, tmp_path, edit, fragment):
    factories.save_prompt_adapter(base, tmp_path, num_virtual_tokens=4)
    factories.edit_adapter_tensors(tmp_path, edit)
    with pytest.raises(InvalidAdapterError, match=fragment):
        load_prompt_adapter("p", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8)


@pytest.mark.parametrize("edits,fragment", [
    (dict(peft_type="P_TUNING"), "peft_type"),
    (dict(peft_type="PREFIX_TUNING"), "peft_type"),
    (dict(num_transformer_submodules=2), "num_transformer_submodules"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
])
def test_unsupported_prompt_configs(base, tmp_path, edits, fragment):
    factories.save_prompt_adapter(base, tmp_path)
    factories.edit_adapter_config(tmp_path, **edits)
    with pytest.raises(UnsupportedAdapterError, match=fragment) as info:
        load_prompt_adapter("tenant-p", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8)
    assert "tenant-p" in str(info.value)


def test_prompt_pickle_needs_opt_in(base, tmp_path):
    peft_model = factories.save_prompt_adapter(base, tmp_path / "st", num_virtual_tokens=2)
    peft_model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    spec = factories.model_spec(base)
    with pytest.raises(UnsafeAdapterError):
        load_prompt_adapter("p", str(tmp_path / "bin"), spec, max_prompt_adapter_tokens=8)
    from_bin = load_prompt_adapter("p", str(tmp_path / "bin"), spec, max_prompt_adapter_tokens=8, allow_pickle=True)
    from_st = load_prompt_adapter("p", str(tmp_path / "st"), spec, max_prompt_adapter_tokens=8)
    assert torch.equal(from_bin.embeddings, from_st.embeddings)
