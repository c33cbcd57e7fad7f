"""The one way a ModelRunner is built: from a WorkerSpec's sizes, a model and the adapter slots it reads.

The engine's own process (tensor_parallel_size=1), its start-up memory profile and every tensor-parallel
rank all build their runner here, so a size added to the runner is passed in one place.
"""

from __future__ import annotations

import dataclasses

import torch

from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.worker.model_runner import ModelRunner


def make_runner(spec: WorkerSpec, model, model_config, *, lora_slots, prompt_slots=None, vocab_slots=None,
                device: torch.device, tp: TensorParallel = SINGLE, num_kv_blocks: int | None = None) -> ModelRunner:
    """A runner of ``spec``'s sizes over ``model`` on ``device``, reading the given adapter slots (LoRA slots
    without the vocabulary ones; prompt and vocabulary slots None when not served). ``num_kv_blocks``
    overrides the spec's (the memory profile's throwaway runner holds one sequence's worth)."""
    if spec.batch_invariant and model_config.quantization is not None:
        # a checkpoint quantized in its config.json (EngineConfig only sees its own quantization option): the
        # quantized GEMMs run outside the batch-invariant mode's row blocks
        raise ValueError("batch_invariant needs an unquantized model; this checkpoint is quantized "
                         f"({type(model_config.quantization).__name__})")
    if num_kv_blocks is not None:
        spec = dataclasses.replace(spec, num_kv_blocks=num_kv_blocks)
    runner = ModelRunner(
        model, model_config, lora_slots, num_kv_blocks=spec.num_kv_blocks, block_size=spec.block_size,
        max_num_tokens=spec.max_num_tokens, max_num_seqs=spec.max_num_seqs,
        max_blocks_per_seq=spec.max_blocks_per_seq, max_loras=spec.max_loras, max_lora_rank=spec.max_lora_rank,
        dtype=spec.dtype, device=device, seed=spec.seed, prompt_slots=prompt_slots, vocab_slots=vocab_slots, tp=tp)
    runner.eos_token_ids = spec.eos_token_ids
    runner.batch_invariant = spec.batch_invariant
    return runner
