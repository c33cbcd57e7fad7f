"""One rank's model, adapter slots and adapter shard.

A rank loads only its shard of the checkpoint (lora_runner.model with ``tp=TensorParallel``: Megatron-style
column / row / vocabulary parallel layers), allocates its LoRA and vocab-LoRA slots at the shard's sizes
(adapters.manager.build_slots, the construction the engine's AdapterManager uses at one rank) and writes
each adapter's shard from the one full CPU copy the engine process validated
(adapters.sharding.shard_lora_weights: views, no copy). Soft prompts are replicated.
"""

from __future__ import annotations

from adapters.lora import LoRAWeights
from adapters.manager import build_slots
from adapters.sharding import shard_lora_weights
from adapters.spec import ModelSpec
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
    soft prompts whole (adapters.manager.build_slots). ``model_spec``: the whole model's."""
    slots = build_slots(model_spec, max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
                        max_prompt_adapters=spec.max_prompt_adapters,
                        max_prompt_adapter_tokens=spec.max_prompt_adapter_tokens, device=spec.rank_device(tp.rank),
                        dtype=spec.dtype, rank=tp.rank, world_size=tp.world_size)
    return {"lora": slots.lora_set, "lora_only": slots.lora, "vocab": slots.vocab, "prompt": slots.prompt}


def shard(weights, spec: ModelSpec, rank: int, world_size: int):
    """Rank ``rank``'s share of one adapter version's weights: a LoRA's shard (``spec`` the whole model's),
    a soft prompt (PromptWeights) whole."""
    if isinstance(weights, LoRAWeights):
        return shard_lora_weights(weights, spec, rank, world_size)
    return weights
