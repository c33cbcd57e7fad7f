"""WorkerSpec: everything one tensor-parallel rank needs to build its model, KV cache, slots and runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WorkerSpec:
    """The picklable sizes and sources a worker process builds its rank from (the engine derives them from
    its EngineConfig and limits; the worker never sees those).

    device_type: "cpu" or "cuda" (rank r uses cuda:r). threads_per_rank: torch intra-op threads of
    each worker (the engine's cpu_threads split over the ranks). own_gpu_only: rank r's process sees one GPU
    (Ray sets CUDA_VISIBLE_DEVICES per actor), so it runs on cuda:0. step_timeout_s: how long the engine
    waits for a step's answer before it declares the workers dead (also the collectives' timeout).
    """

    model: str
    revision: str | None
    local_files_only: bool | None
    quantization: str | None
    dtype: torch.dtype
    device_type: str
    num_kv_blocks: int
    block_size: int
    max_num_tokens: int
    max_num_seqs: int
    max_blocks_per_seq: int
    max_loras: int
    max_lora_rank: int
    max_prompt_adapters: int
    max_prompt_adapter_tokens: int
    seed: int
    eos_token_ids: frozenset[int]
    threads_per_rank: int
    step_timeout_s: float
    startup_timeout_s: float = 600.0
    own_gpu_only: bool = False  # each rank's process sees only its GPU (a Ray actor): every rank uses cuda:0
    batch_invariant: bool = False  # EngineConfig.batch_invariant: the runner runs its steps in that mode

    def rank_device(self, rank: int) -> torch.device:
        """The device rank `rank` runs on."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.own_gpu_only else rank)
