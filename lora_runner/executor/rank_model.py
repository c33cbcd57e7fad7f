"""One rank's model, adapter slots and adapter shard.

A rank loads only its shard of the checkpoint (lora_runner.model with ``tp=TensorParallel``: Megatron-style
column / row / vocabulary parallel layers), allocates its LoRA and vocab-LoRA slots at the shard's sizes
(adapters.sharding.shard_spec) and writes each adapter's shard from the one full CPU copy the engine
process validated (adapters.sharding.shard_lora_weights: views, no copy). Soft prompts are replicated.
"""

from __future__ import annotations

from adapters.lora import LoRAWeights
from adapters.sharding import shard_lora_weights, shard_spec
from adapters.slots import LoRASlots, PromptSlots
from adapters.spec import ModelSpec
from adapters.vocab_slots import SlotGroup, VocabLoRASlots
from lora_runner.distributed import TensorParallel
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.model import load_model


def build_rank_model(spec: WorkerSpec, tp: TensorParallel):
    """(model shard, the whole model's ModelConfig, model_dir) of rank ``tp.rank``."""
    return load_model(spec.model, revision=spec.revision, dtype=spec.dtype, device=spec.rank_device(tp.rank),
                      local_files_only=spec.local_files_only, quantization=spec.quantization, tp=tp)


def build_rank_slots(spec: WorkerSpec, model_spec: ModelSpec, tp: TensorParallel) -> dict:
    """The rank's adapter slots by kind, as AdapterManager builds them: {"lora": LoRA (+ vocab) slots,
    "vocab": VocabLoRASlots or None, "prompt": PromptSlots}: LoRA and vocab slots at the rank's shard sizes,
    soft prompts whole. ``model_spec``: the whole model's."""
    device = spec.rank_device(tp.rank)
    local = shard_spec(model_spec, tp.rank, tp.world_size)
    lora = LoRASlots(local, spec.max_loras, spec.max_lora_rank, device, spec.dtype)
    vocab = (VocabLoRASlots(local, spec.max_loras, spec.max_lora_rank, device, spec.dtype)
             if model_spec.vocab_size is not None and spec.max_loras > 0 else None)
    prompt = PromptSlots(model_spec, spec.max_prompt_adapters, spec.max_prompt_adapter_tokens, device, spec.dtype)
    return {"lora": lora if vocab is None else SlotGroup(lora, vocab), "lora_only": lora, "vocab": vocab,
            "prompt": prompt}


def shard(weights, spec: ModelSpec, rank: int, world_size: int):
    """Rank ``rank``'s share of one adapter version's weights: a LoRA's shard (``spec`` the whole model's),
    a soft prompt (PromptWeights) whole."""
    if isinstance(weights, LoRAWeights):
        return shard_lora_weights(weights, spec, rank, world_size)
    return weights
