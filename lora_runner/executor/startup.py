"""Starting the executor: the process topology an EngineConfig asks for, and what each part holds.

``start_executor`` is the engine's one call at start-up (vLLM's Executor owns its workers):

- "uni" (tensor_parallel_size=1): the model, its adapter slots, the KV cache and the runner live in this
  process; on CUDA the start-up memory profile sizes the KV cache and the decode graphs are captured
  (with speculative decoding, the verify graphs of k + 1 tokens per sequence too). DoRA's base weights
  come from the live model.
- "mp" / "ray": one worker process (or Ray actor) per rank holds its model shard, KV cache, slots and runner
  (lora_runner.executor.rank_worker); this process keeps the adapter tiers, whose slots are proxies, and
  reads DoRA's base weights from the checkpoint (no rank holds a whole row).

A "draft_model" speculator's model is loaded in this process (either way) before the KV budget is decided,
and its weights and KV cache share that budget with the target's (lora_runner.executor.draft_budget); its
adapter slots, allocated when the engine builds the speculator over it (after the memory profile on CUDA),
are taken off the budget first.

Either way the adapter manager's weights are validated once here, and the runtime sizes (EngineLimits) are
decided here from the model and the device. The LoRA slots' bytes are logged (a mixture of experts' slot
holds every expert's LoRA: 1.59 GiB for Qwen3-30B-A3B at rank 16 in bf16) and left out of the KV cache:
in this process they are checked against the free device memory before they are allocated, then
measured (the memory profile's resident bytes; on CPU the RAM left); for worker ranks on CPU they are
taken off the RAM available before the ranks allocate them, as is the LoRA CPU cache's byte bound
(max_cpu_lora_bytes: the cache fills later). The engine's own process ("uni") on CPU sizes its KV
cache from the RAM left after its slots, less an explicitly set max_cpu_lora_bytes (the operator said
how much the cache may take). Its default bound is not taken off there: it is max_cpu_loras adapters
of the largest size at max_lora_rank, an upper bound that real adapters (a few target modules, lower
ranks) seldom approach, and taking it off would shrink the KV cache of every existing CPU setup whose
sizes follow from the RAM reported (tests/test_startup.py pins them). A draft model's adapters have a
CPU cache of their own whose bound follows the same rule (lora_runner.executor.draft_budget).
The engine sets the end ids afterwards (the executor's setter).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from adapters.manager import AdapterManager
from adapters.sharding import check_splits
from adapters.slot_memory import cpu_cache_bytes, lora_slot_bytes
from lora_runner.config import EngineConfig
from lora_runner.device import available_host_memory
from lora_runner.distributed import TensorParallel
from lora_runner.executor.base import Executor
from lora_runner.executor.draft_budget import DraftMemory, draft_memory, limits_with_draft
from lora_runner.executor.limits import EngineLimits, step_sizes
from lora_runner.executor.multiproc import MultiprocExecutor
from lora_runner.executor.runner_factory import make_runner
from lora_runner.executor.uniproc import UniProcExecutor
from lora_runner.executor.worker_spec import WorkerSpec
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.checkpoint_base_weights import checkpoint_base_weights
from lora_runner.model.layers import lora_base_weights
from lora_runner.model.llama import check_attention_split
from lora_runner.model.loader import resolve_model_dir
from lora_runner.worker.cuda_graphs import cuda_graphs_available
from lora_runner.worker.draft_runner import LoadedDraft, load_draft
from lora_runner.worker.kv_cache import kv_block_bytes
from lora_runner.worker.memory_profile import profile_kv_cache_budget
from lora_runner.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class StartedExecutor:
    """What start-up made: the executor, the adapter manager over its slots, the model's config and
    directory, the runtime sizes, and in this process ("uni") the model and its runner (else None), and the
    speculative draft model where it was loaded at start-up (else None: the engine loads it)."""

    executor: Executor
    manager: AdapterManager
    model_config: ModelConfig
    model_dir: str
    limits: EngineLimits
    model: torch.nn.Module | None = None
    runner: ModelRunner | None = None
    draft: LoadedDraft | None = None  # the "draft_model" method's model, loaded before the memory profile ("uni")


def start_executor(cfg: EngineConfig, threads: int, on_load_done=None) -> StartedExecutor:
    """Start what ``cfg.executor_backend`` names (see the module docstring). ``threads``: the engine's CPU
    threads (split over the ranks); ``on_load_done``: called when a background adapter load ends."""
    if cfg.executor_backend == "uni":
        return _start_in_process(cfg, on_load_done)
    return _start_workers(cfg, threads, on_load_done)


def worker_spec(cfg: EngineConfig, model_config: ModelConfig, limits: EngineLimits, threads: int) -> WorkerSpec:
    """The sizes and sources every runner of this engine is built from (in this process or a worker's)."""
    _, max_batched, max_blocks_per_seq = step_sizes(cfg, model_config.max_position_embeddings, limits.max_model_len)
    return WorkerSpec(
        model=cfg.model, revision=cfg.revision, local_files_only=cfg.local_files_only,
        quantization=cfg.quantization, dtype=cfg.torch_dtype(), device_type=cfg.torch_device().type,
        num_kv_blocks=limits.num_kv_blocks, block_size=cfg.block_size, max_num_tokens=max_batched,
        max_num_seqs=cfg.max_num_seqs, max_blocks_per_seq=max_blocks_per_seq, max_loras=cfg.max_loras,
        max_lora_rank=cfg.max_lora_rank, max_prompt_adapters=cfg.max_prompt_adapters,
        max_prompt_adapter_tokens=cfg.max_prompt_adapter_tokens, seed=cfg.seed, eos_token_ids=frozenset(),
        threads_per_rank=max(1, threads // cfg.tensor_parallel_size), step_timeout_s=cfg.worker_step_timeout_s,
        own_gpu_only=cfg.executor_backend == "ray", batch_invariant=cfg.batch_invariant)


def _make_manager(cfg: EngineConfig, model_config: ModelConfig, device: torch.device, base_weight,
                  on_load_done, make_slots=None) -> AdapterManager:
    """The adapter tiers; their weights live on ``device`` (the CPU when the slots are in worker processes)."""
    return AdapterManager(
        model_config.spec(), max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
        max_cpu_loras=cfg.cpu_loras, max_prompt_adapters=cfg.max_prompt_adapters,
        max_prompt_adapter_tokens=cfg.max_prompt_adapter_tokens, device=device, dtype=cfg.torch_dtype(),
        allow_pickle=cfg.allow_pickle, local_files_only=cfg.local_files_only,
        max_adapter_bytes=cfg.max_adapter_bytes, on_load_done=on_load_done, base_weight=base_weight,
        make_slots=make_slots, max_cpu_lora_bytes=cfg.max_cpu_lora_bytes,
        max_memory_adapter_bytes=cfg.max_memory_adapter_bytes,
        max_cpu_prompt_adapter_bytes=cfg.max_cpu_prompt_adapter_bytes)


def _start_in_process(cfg: EngineConfig, on_load_done) -> StartedExecutor:
    """The "uni" backend: model, slots, KV cache and runner in this process (see the module docstring)."""
    device, dtype = cfg.torch_device(), cfg.torch_dtype()
    model, model_config, model_dir = load_model(
        cfg.model, revision=cfg.revision, dtype=dtype, device=device, local_files_only=cfg.local_files_only,
        quantization=cfg.quantization)
    # checked before they are allocated; once they are, the memory profile (CUDA) or the RAM left (CPU) counts them
    lora_slot_memory(cfg, model_config, torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None)
    manager = _make_manager(cfg, model_config, device, lora_base_weights(model), on_load_done)
    runner_of = partial(_runner_of_manager, cfg, model, model_config, manager, device)
    use_graphs = not cfg.enforce_eager and cuda_graphs_available(device)
    spec = cfg.speculative()
    k = spec.num_speculative_tokens if spec is not None else 0  # the verify graphs' k
    host_ram = in_process_host_ram(cfg) if device.type == "cpu" else None  # before the draft: its weights come off it
    # loaded before the memory profile, so its weights count as resident (lora_runner.executor.draft_budget)
    draft = _load_draft(cfg, device)
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    kv_budget = None
    if device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
        max_model_len, max_batched, _ = step_sizes(cfg, model_config.max_position_embeddings)
        kv_budget = profile_kv_cache_budget(
            runner_of(None), manager.loras, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=max_model_len,
            block_size=cfg.block_size, gpu_memory_utilization=cfg.gpu_memory_utilization, cuda_graphs=use_graphs,
            verify_tokens_per_seq=k + 1 if k else 0)
    # the draft's KV cache shares whichever budget this is, block for block with the target's
    limits = limits_with_draft(cfg, model_config.max_position_embeddings, kv_block_bytes(model_config, 1, dtype),
                               draft_memory(draft, cfg) if draft is not None else None, free, kv_budget, host_ram,
                               with_cpu_cache=cfg.max_cpu_lora_bytes is not None)  # in_process_host_ram's rule
    make = runner_of(limits)
    runner = make(limits.num_kv_blocks)
    if use_graphs:
        runner.capture_decode_graphs(manager.loras, cfg.max_lora_rank, num_speculative_tokens=k)
    return StartedExecutor(UniProcExecutor(runner, make), manager, model_config, model_dir, limits, model, runner,
                           draft)


def in_process_host_ram(cfg: EngineConfig) -> int:
    """The RAM the "uni" engine on CPU sizes its KV cache from: what is available now (its slots already
    allocated), less an explicitly set ``max_cpu_lora_bytes``, which the LoRA CPU cache fills later. The
    default bound is not taken off (module docstring)."""
    return max(available_host_memory() - (cfg.max_cpu_lora_bytes or 0), 0)


def _load_draft(cfg: EngineConfig, device: torch.device) -> LoadedDraft | None:
    """The "draft_model" speculator's model, loaded in this process before the KV budget is decided (None
    for any other method): its weights and KV cache are in that budget (lora_runner.executor.draft_budget)."""
    spec = cfg.speculative()
    if spec is None or spec.method != "draft_model":
        return None
    return load_draft(spec, dtype=cfg.torch_dtype(), device=device, local_files_only=cfg.local_files_only)


def _runner_of_manager(cfg: EngineConfig, model, model_config: ModelConfig, manager: AdapterManager,
                       device: torch.device, limits: EngineLimits | None) -> Callable[[int], ModelRunner]:
    """make(num_kv_blocks) -> a runner over ``manager``'s slots, sized by ``limits`` (None: the defaults the
    start-up memory profile runs with, before the limits exist)."""
    if limits is None:
        max_model_len, max_batched, max_blocks = step_sizes(cfg, model_config.max_position_embeddings)
        limits = EngineLimits(max_model_len=max_model_len, max_num_batched_tokens=max_batched, num_kv_blocks=0,
                              max_blocks_per_seq=max_blocks)
    spec = worker_spec(cfg, model_config, limits, threads=1)

    def make(num_kv_blocks: int) -> ModelRunner:
        return make_runner(spec, model, model_config, lora_slots=manager.lora_slots,
                           prompt_slots=manager.prompt_slots, vocab_slots=manager.vocab_slots, device=device,
                           num_kv_blocks=num_kv_blocks)

    return make


def _start_workers(cfg: EngineConfig, threads: int, on_load_done) -> StartedExecutor:
    """The "mp" and "ray" backends (tensor_parallel_size > 1, or 1 when asked for): one worker per rank."""
    device, dtype = cfg.torch_device(), cfg.torch_dtype()
    if device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
        raise ValueError("tensor_parallel_size > 1 on CUDA needs kv_cache_memory_bytes (per rank): the "
                         "start-up memory profile runs in one process only")
    model_dir = resolve_model_dir(cfg.model, revision=cfg.revision, local_files_only=cfg.local_files_only)
    model_config = ModelConfig.from_dir(model_dir, name_or_path=cfg.model, quantization=cfg.quantization)
    check_splits(model_config.spec(), cfg.tensor_parallel_size)  # ValueError before any process starts
    check_attention_split(model_config, cfg.tensor_parallel_size)
    host_ram = available_host_memory() if device.type == "cpu" else None  # before the draft: its weights come off it
    draft = _load_draft(cfg, device)  # on the engine's side, unsharded (lora_runner.spec_decode.draft_model)
    limits = worker_limits(cfg, model_config, draft_memory(draft, cfg) if draft is not None else None, host_ram)
    executor = _rank_executor(cfg.executor_backend)(worker_spec(cfg, model_config, limits, threads),
                                                    cfg.tensor_parallel_size)
    # DoRA's norms need whole rows of W, which no rank holds: read from the checkpoint (dequantized)
    manager = _make_manager(cfg, model_config, torch.device("cpu"),
                            checkpoint_base_weights(model_dir, model_config, dtype), on_load_done,
                            make_slots=executor.slot_proxy)
    return StartedExecutor(executor, manager, model_config, model_dir, limits, draft=draft)


def worker_limits(cfg: EngineConfig, model_config: ModelConfig, draft: DraftMemory | None = None,
                  available_host_bytes: int | None = None) -> EngineLimits:
    """The runtime sizes of an engine whose ranks are worker processes, decided before they start: on
    CPU the host's RAM holds every rank's KV blocks and LoRA slots (the latter not allocated yet, so
    taken off the RAM available: ``available_host_bytes``, None: asked of the OS now, as is the bound of this
    process's LoRA CPU cache); on CUDA kv_cache_memory_bytes is per rank. A draft model (in this process)
    shares the budget (lora_runner.executor.draft_budget)."""
    device, dtype = cfg.torch_device(), cfg.torch_dtype()
    # a block on one rank (its KV heads); the host's memory holds every rank's blocks, a GPU one rank's
    rank_block = kv_block_bytes(model_config, 1, dtype, TensorParallel(0, cfg.tensor_parallel_size))
    slots = lora_slot_memory(cfg, model_config)
    host_ram = None
    if device.type == "cpu":
        cache = cpu_cache_bytes(model_config.spec(), cfg.cpu_loras, cfg.max_lora_rank, dtype, cfg.max_cpu_lora_bytes)
        available = available_host_memory() if available_host_bytes is None else available_host_bytes
        host_ram = max(available - slots - cache, 0)
    return limits_with_draft(cfg, model_config.max_position_embeddings,
                             rank_block * (cfg.tensor_parallel_size if device.type == "cpu" else 1), draft, None,
                             cfg.kv_cache_memory_bytes if device.type == "cuda" else None, host_ram,
                             with_cpu_cache=True)  # the draft adapters' cache bound too, as the model's above


def lora_slot_memory(cfg: EngineConfig, model_config: ModelConfig, free_bytes: int | None = None) -> int:
    """Bytes the ``max_loras`` LoRA slots of every rank take together, logged per slot (a mixture of
    experts' slot holds every expert's LoRA: adapters.slot_memory). ValueError naming them when that is
    more than ``free_bytes`` (the device memory free after the weights; None: not checked)."""
    if cfg.max_loras == 0:
        return 0
    ranks, dtype = cfg.tensor_parallel_size, cfg.torch_dtype()
    per_rank = [lora_slot_bytes(model_config.spec(), cfg.max_lora_rank, dtype, rank, ranks) for rank in range(ranks)]
    total = cfg.max_loras * sum(b.per_slot for b in per_rank)
    where = f" on each of {ranks} ranks" if ranks > 1 else ""
    logger.info("LoRA slots at max_lora_rank=%d in %s%s: %s", cfg.max_lora_rank, dtype, where,
                per_rank[0].describe(cfg.max_loras))
    if free_bytes is not None and total > free_bytes:
        raise ValueError(f"max_loras={cfg.max_loras} LoRA slots at max_lora_rank={cfg.max_lora_rank} take "
                         f"{per_rank[0].describe(cfg.max_loras)}, more than the {free_bytes / 2**30:.2f} GiB free "
                         "after the weights: lower max_loras or max_lora_rank")
    return total


def _rank_executor(backend: str) -> type:
    """The executor class of a backend with one worker per rank: "mp" or "ray"."""
    if backend == "ray":
        # imported here: Ray is an optional dependency (lora-runner[ray]), needed only by this backend
        from lora_runner.executor.ray_executor import RayExecutor

        return RayExecutor
    return MultiprocExecutor
