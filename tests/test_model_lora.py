"""LoRA in the model: a mixed batch of slots (-1 and several adapters) vs PEFT's forward per adapter.

PEFT writes each adapter; the test reads the saved safetensors back and fills slot tensors exactly
as docs/internals.md lays them out (lora_a[slot, j, :r] = A_j; lora_b[slot, off_j:off_j+N_j, :r] =
B_j * scaling). The model calls the real punica_kernels.add_lora with a prepared LoRAMeta.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from factories import save_lora
from lora_runner.model.forward_context import LoRAContext
from test_model_harness import PagedDriver, assert_close, hf_logits, make_checkpoint

punica_kernels = pytest.importorskip("punica_kernels")
if not hasattr(punica_kernels, "LoRAMeta"):
    pytest.skip("punica_kernels.LoRAMeta is not implemented yet", allow_module_level=True)

_LORA_KEY = re.compile(r"base_model\.model\.(.+)\.lora_([AB])\.weight")
MAX_LORAS, MAX_RANK = 4, 16
ADAPTERS = {  # name -> (slot, save_lora kwargs)
    "all-r8": (2, dict(seed=1, r=8, lora_alpha=16)),
    "qv-down-rslora-r4": (0, dict(seed=2, r=4, lora_alpha=8, use_rslora=True,
                                  target_modules=("q_proj", "v_proj", "down_proj"))),
    "kgo-up-r16": (3, dict(seed=3, r=16, lora_alpha=8, target_modules=("k_proj", "o_proj", "gate_proj", "up_proj"))),
}


class SlotWeights:
    """Test double of the adapter manager's LoRASlots: .weights(layer, name) -> (lora_a, lora_b),
    .scales(layer, name) -> (slice_scales, column_scales), for each of the spec's LoRA modules."""

    def __init__(self, spec):
        self.spec = spec
        self.tensors = {}
        for module in spec.modules:
            self.tensors[module.key] = (torch.zeros(MAX_LORAS, len(module.slice_sizes), MAX_RANK, module.in_features),
                                        torch.zeros(MAX_LORAS, module.out_features, MAX_RANK))

    def weights(self, layer: int, packed: str):
        return self.tensors[layer, packed]

    def scales(self, layer: int, packed: str):
        """Unit slice and column scales (this double folds the scaling into B; no DoRA)."""
        lora_a, lora_b = self.tensors[layer, packed]
        return torch.ones(MAX_LORAS, lora_a.shape[1]), torch.ones(MAX_LORAS, lora_b.shape[1])

    def write(self, slot: int, adapter_dir: Path) -> None:
        """Copy a PEFT checkpoint into `slot`, folding alpha/r (or alpha/sqrt(r)) into B."""
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        r = config["r"]
        scaling = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        written = 0
        targets = self.spec.peft_targets()  # PEFT module path -> (LoRA module, (its slice,))
        for key, tensor in load_file(str(adapter_dir / "adapter_model.safetensors")).items():
            path, which = _LORA_KEY.fullmatch(key).groups()
            module, (j,) = targets[path]
            lora_a, lora_b = self.tensors[module.key]
            if which == "A":
                lora_a[slot, j, :r] = tensor  # A_j [r, K]
            else:
                offset = module.slice_offsets[j]
                lora_b[slot, offset:offset + tensor.shape[0], :r] = tensor * scaling  # B_j [N_j, r]
            written += 1
        assert written > 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_lora_batch_matches_peft(tmp_path, arch):
    ckpt = make_checkpoint(tmp_path / "base", arch, biases=arch == "qwen2")
    slots = SlotWeights(ckpt.config.spec())
    peft_models = {}
    for name, (slot, kwargs) in ADAPTERS.items():
        peft_models[name] = save_lora(ckpt.hf, tmp_path / name, **kwargs)
        slots.write(slot, tmp_path / name)
    meta = punica_kernels.LoRAMeta(64, MAX_LORAS, "cpu")
    lora = LoRAContext(meta=meta, slots=slots)

    # sequences: base, each adapter, and a second user of one adapter
    seq_adapter = {0: None, 1: "all-r8", 2: "qv-down-rslora-r4", 3: "kgo-up-r16", 4: "all-r8"}
    steps = [  # (sequence, new tokens) per step
        [(0, 5), (1, 4), (2, 6), (3, 3)],  # prompts
        [(0, 4), (1, 1), (2, 1), (3, 1), (4, 8)],  # rest of 0's prompt, decodes, a second user of "all-r8"
        [(s, 1) for s in (4, 3, 2, 1)],  # decode only
    ]
    gen = torch.Generator().manual_seed(0)
    full = {s: torch.randint(3, 256, (sum(n for step in steps for t, n in step if t == s),), generator=gen)
            for s in seq_adapter}
    expected = {s: hf_logits(ckpt.hf if a is None else peft_models[a], full[s]) for s, a in seq_adapter.items()}

    driver = PagedDriver(ckpt.model, ckpt.config, block_size=4, seed=1)
    start = dict.fromkeys(seq_adapter, 0)
    for step, plan in enumerate(steps):
        chunks = [(s, full[s][start[s]:start[s] + n]) for s, n in plan]
        num_padding = 2 if step == 1 else 0
        token_slots = [ADAPTERS[seq_adapter[s]][0] if seq_adapter[s] else -1 for s, n in plan for _ in range(n)]
        punica_kernels.load_table(meta, torch.tensor(token_slots + [-1] * num_padding))
        for (s, tokens), got in zip(chunks, driver.step(chunks, lora=lora, num_padding=num_padding)):
            assert_close(got, expected[s][start[s]:start[s] + len(tokens)],
                         f"step {step}, sequence {s} ({seq_adapter[s] or 'base'})")
            start[s] += len(tokens)


def test_lora_changes_logits_and_empty_slot_is_base(tmp_path):
    """Guards the comparison above: an adapter's delta is far above tolerance; an all-zero slot is exact base."""
    ckpt = make_checkpoint(tmp_path / "base", "llama")
    slots = SlotWeights(ckpt.config.spec())
    slots.write(2, _saved(ckpt, tmp_path / "a", seed=1, r=8, lora_alpha=16))
    meta = punica_kernels.LoRAMeta(16, MAX_LORAS, "cpu")
    tokens = torch.randint(3, 256, (6,), generator=torch.Generator().manual_seed(5))
    base = hf_logits(ckpt.hf, tokens)
    results = {}
    for slot in (2, 1):  # slot 1 was never written: zero weights
        punica_kernels.load_table(meta, torch.full((6,), slot))
        (results[slot],) = PagedDriver(ckpt.model, ckpt.config).step([(0, tokens)], lora=LoRAContext(meta, slots))
    assert (results[2] - base).abs().max() > 1e-2
    assert_close(results[1], base, "empty slot")


def _saved(ckpt, path: Path, **kwargs) -> Path:
    save_lora(ckpt.hf, path, **kwargs)
    return path
