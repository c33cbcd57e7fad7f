"""One rank's model, adapter slots and adapter shard: the three places the sharded model plugs in.

Until the sharded model lands (lora_runner.model with ``tp=TensorParallel``, adapters.sharding), a rank
holds the whole model (replicated) and the whole adapter: tp > 1 then gives tokens equal to tp=1 and
exercises every process, message and failure path. Swapping in the sharded versions changes these
functions only.
"""

from __future__ import annotations

from adapters.slots import LoRASlots, PromptSlots
from adapters.spec import ModelSpec
from adapters.vocab_slots import SlotGroup, VocabLoRASlots
from lora_runner.distributed import TensorParallel
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.model import load_model


def build_rank_model(spec: WorkerSpec, tp: TensorParallel):
    """(model, ModelConfig, model_dir) of rank ``tp.rank``: today the whole model, replicated."""
    return load_model(spec.model, revision=spec.revision, dtype=spec.dtype, device=spec.rank_device(tp.rank),
                      local_files_only=spec.local_files_only, quantization=spec.quantization)


def build_rank_slots(spec: WorkerSpec, model_spec: ModelSpec, tp: TensorParallel) -> dict:
    """The rank's adapter slots by kind, as AdapterManager builds them: {"lora": LoRA (+ vocab) slots,
    "vocab": VocabLoRASlots or None, "prompt": PromptSlots} (sized by the rank's model spec)."""
    device = spec.rank_device(tp.rank)
    lora = LoRASlots(model_spec, spec.max_loras, spec.max_lora_rank, device, spec.dtype)
    vocab = (VocabLoRASlots(model_spec, spec.max_loras, spec.max_lora_rank, device, spec.dtype)
             if model_spec.vocab_size is not None and spec.max_loras > 0 else None)
    prompt = PromptSlots(model_spec, spec.max_prompt_adapters, spec.max_prompt_adapter_tokens, device, spec.dtype)
    return {"lora": lora if vocab is None else SlotGroup(lora, vocab), "lora_only": lora, "vocab": vocab,
            "prompt": prompt}


def shard(weights, spec: ModelSpec, rank: int, world_size: int):
    """Rank ``rank``'s share of one adapter version's weights (LoRAWeights or PromptWeights): today the
    whole adapter, as the model is replicated (a soft prompt stays whole once the model is sharded too)."""
    return weights
