"""LoRA slot layout: computing with the slot tensors the way the kernels do gives PEFT's delta."""

import dataclasses

import pytest
import torch

from adapters.lora import dummy_lora, load_lora
from adapters.slots import LoRASlots, zeros_b
from adapters.vocab_slots import VocabLoRASlots
from tests import factories


@pytest.fixture(scope="module")
def base():
    return factories.build_tiny_model("llama", seed=4)


def _slot_delta(slots, slot, module, x):
    """The kernels' semantics: y[:, off_j:off_j+N_j] = g[s, j] * (x @ lora_a[s, j].T) @ lora_b[s, off_j:off_j+N_j].T."""
    lora_a, lora_b = slots.weights(*module.key)  # [S, n, R, K], [S, N, R]
    slice_scales, column_scales = slots.scales(*module.key)  # [S, n], [S, N]
    outs, offset = [], 0
    for j, width in enumerate(module.slice_sizes):
        inter = (x.double() @ lora_a[slot, j].double().T) * slice_scales[slot, j].double()
        outs.append(inter @ lora_b[slot, offset:offset + width].double().T)
        offset += width
    assert (column_scales[slot] == 1).all()  # plain LoRA: no DoRA scale
    return torch.cat(outs, dim=1)  # [T, N]


def _peft_delta(peft_model, lora_module, x):
    outs = []
    for path, _ in lora_module.peft_modules:  # split projections: one per slice, in slot order
        module = peft_model.base_model.model.get_submodule(path)
        with torch.no_grad():
            outs.append(module(x) - module.base_layer(x) if hasattr(module, "base_layer")
                        else torch.zeros(x.shape[0], module.out_features))
    return torch.cat(outs, dim=1).double()  # [T, N]


@pytest.mark.parametrize("kwargs", [
    dict(r=8, lora_alpha=16),
    dict(r=4, rank_pattern={"k_proj": 2, "up_proj": 8}, alpha_pattern={"o_proj": 1}, use_rslora=True),
    dict(r=3, target_modules=["v_proj", "gate_proj"], layers_to_transform=[0]),
])
def test_slot_layout_reproduces_peft_after_larger_tenant(base, tmp_path, kwargs):
    spec = factories.model_spec(base)
    slots = LoRASlots(spec, max_loras=3, max_lora_rank=8)
    for module in spec.modules:
        for tensor in (*slots.weights(*module.key), *slots.scales(*module.key)):
            tensor.fill_(float("nan"))  # poison: everything the adapter does not write must be reset
    peft_model = factories.save_lora(base, tmp_path, seed=7, **kwargs)
    adapter = load_lora("a", str(tmp_path), spec, max_lora_rank=8)
    slots.write(1, dummy_lora("big", spec, rank=8, seed=3))  # a larger tenant leaves values everywhere
    slots.write(1, adapter)
    assert slots.slot_ranks.tolist() == [0, adapter.rank, 0]
    assert len(spec.modules) == 4 * spec.num_layers
    for module in spec.modules:
        x = torch.randn(6, module.in_features)
        torch.testing.assert_close(_slot_delta(slots, 1, module, x), _peft_delta(peft_model, module, x),
                                   rtol=1e-4, atol=1e-5)
        lora_a, lora_b = slots.weights(*module.key)
        assert torch.isnan(lora_a[0]).all() and torch.isnan(lora_b[2]).all()  # neighbours untouched
        assert all(torch.isnan(scales[[0, 2]]).all() for scales in slots.scales(*module.key))
        assert lora_a[1].is_contiguous() and lora_a.data_ptr() == slots.weights(*module.key)[0].data_ptr()


def test_slot_shapes_and_clear(base):
    spec = factories.model_spec(base)
    slots = LoRASlots(spec, max_loras=2, max_lora_rank=4, dtype=torch.float16)
    for module in spec.modules:
        lora_a, lora_b = slots.weights(*module.key)
        n, widths = len(module.slice_sizes), module.slice_sizes
        assert lora_a.shape == (2, n, 4, module.in_features) and lora_a.dtype == torch.float16
        assert lora_b.shape == (2, sum(widths), 4)
    slots.write(0, dummy_lora("d", spec, rank=4, dtype=torch.float16))
    assert slots.slot_ranks.dtype == torch.int32 and slots.slot_ranks.tolist() == [4, 0]
    slots.clear(0)
    assert slots.slot_ranks.tolist() == [0, 0]
    with pytest.raises(ValueError):
        LoRASlots(spec, max_loras=2, max_lora_rank=0)


def test_cpu_slots_keep_b_columns_contiguous(base):
    """On the CPU every B factor is the transposed view of [..., R, N] storage (the torch path's
    expand multiplies by B.T: N contiguous is its fast layout); shapes stay [..., N, R]."""
    spec = factories.model_spec(base)
    slots = LoRASlots(spec, max_loras=3, max_lora_rank=4)
    for module in spec.modules:
        lora_b = slots.weights(*module.key)[1]  # [3, N, 4]
        assert lora_b.shape == (3, module.out_features, 4)
        assert lora_b.stride()[1:] == (1, lora_b.shape[1]) and lora_b.transpose(1, 2).is_contiguous()
    vocab = VocabLoRASlots(dataclasses.replace(spec, vocab_size=base.config.vocab_size), 3, 4)
    for lora_b in (vocab.embedding_b, vocab.lm_head_b):
        assert lora_b.stride()[1:] == (1, lora_b.shape[1]), lora_b.stride()


@pytest.mark.gpu
def test_cuda_slots_keep_b_contiguous():
    """The Triton expand reads B rows of R: on CUDA the buffer is plain contiguous [..., N, R]."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lora_b = zeros_b(2, 3, 64, 16, dtype=torch.bfloat16, device="cuda")
    assert lora_b.shape == (2, 3, 64, 16) and lora_b.is_contiguous() and not lora_b.any()
