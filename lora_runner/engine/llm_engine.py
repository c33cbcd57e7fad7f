"""LLMEngine: requests in, one continuously batched step at a time, RequestOutputs out.

``step()`` = take new requests and aborts -> scheduler.schedule() -> make the step's LoRAs and soft
prompts resident -> runner.execute() -> scheduler.postprocess() (append tokens, detokenize
incrementally, stop checks: lora_runner.engine.output_processor; finish requests, free blocks) -> release
adapters -> outputs. Adapters load in the background (acquired at add_request); the scheduler only
admits requests whose adapters are ready, so a slow download never stalls running requests.
Both adapter kinds go through one seam, lora_runner.engine.adapters (which also describes prompt
adapters as placeholder tokens); pins and load state live in the adapter tiers only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from functools import partial
from itertools import count

import torch

from adapters import LoRARequest, PromptAdapterRequest
from adapters.manager import AdapterManager
from adapters.sharding import check_splits
from lora_runner.config import EngineConfig
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.fairness import VirtualTokenCounter
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.core.scheduler_output import SchedulerOutput
from lora_runner.device import available_host_memory, set_cpu_threads
from lora_runner.distributed import TensorParallel
from lora_runner.engine.adapter_api import AdapterAPI
from lora_runner.engine.adapters import EngineAdapters
from lora_runner.engine.bad_words import bad_words_token_ids
from lora_runner.engine.errors import EngineDeadError
from lora_runner.engine.input_processor import InputProcessor, abort_ids
from lora_runner.engine.intake import Intake
from lora_runner.engine.limits import engine_limits, step_sizes
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.engine.stats import EngineStats
from lora_runner.engine.structured import StructuredOutputs, grammar_state
from lora_runner.engine.tokenizer import LazyTokenizer, eos_token_ids
from lora_runner.executor import MultiprocExecutor, UniProcExecutor, WorkerSpec
from lora_runner.model import ModelConfig, load_model
from lora_runner.model.loader import resolve_model_dir
from lora_runner.model.checkpoint_base_weights import checkpoint_base_weights
from lora_runner.model.layers import lora_base_weights
from lora_runner.outputs import RequestOutput
from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.cuda_graphs import cuda_graphs_available
from lora_runner.worker.kv_cache import kv_block_bytes
from lora_runner.worker.memory_profile import profile_kv_cache_budget
from lora_runner.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLMEngine(AdapterAPI):
    """The serving engine: ``add_request``, ``step``, ``abort_request``, ``has_unfinished_requests``.

    Build it from an EngineConfig or from the same keyword arguments
    (``LLMEngine("path/or/repo", max_loras=4, ...)``). add_request, abort_request and add_lora may
    be called from other threads while one thread loops on step(): they only touch the intake
    (lora_runner.engine.intake), which step() moves into the scheduler at its start. A loop on step() can
    call ``wait_for_work(timeout)`` between steps to sleep while every request waits for an adapter
    load. After ``close()`` the adding and adapter-management calls raise EngineClosedError.

    Parts: ``intake`` (thread-safe add/abort), ``inputs`` (argument checks, lora_runner.engine.
    input_processor), ``adapters`` (the seam to both adapter kinds; its ``manager`` holds the tiers),
    ``scheduler``, ``block_manager``, ``runner``, ``output_processor``.
    """

    def __init__(self, model: str | EngineConfig, **kwargs) -> None:
        if isinstance(model, EngineConfig) and kwargs:
            raise ValueError("pass either an EngineConfig or keyword arguments, not both")
        self.config = model if isinstance(model, EngineConfig) else EngineConfig(model=model, **kwargs)
        cfg = self.config
        self.intake = Intake()
        self._dead: EngineDeadError | None = None  # set when the executor died: nothing can be served
        device, dtype = cfg.torch_device(), cfg.torch_dtype()
        threads = set_cpu_threads(cfg.cpu_threads) if device.type == "cpu" or cfg.cpu_threads is not None else 1
        if cfg.executor_backend == "uni":
            manager, use_graphs = self._start_in_process(cfg, device, dtype)
        else:
            manager, use_graphs = self._start_workers(cfg, device, dtype, threads)
        self.adapters = EngineAdapters(manager, self.limits.max_model_len, cfg.max_prompt_adapters > 0)
        self.block_manager = BlockManager(self.limits.num_kv_blocks, cfg.block_size,
                                          enable_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=cfg.max_num_seqs,
                                   max_num_batched_tokens=self.limits.max_num_batched_tokens,
                                   max_loras=cfg.max_loras, adapter_state=manager.loras.state,
                                   reserved_lora_slots=manager.loras.reserved_slots,
                                   max_prompt_adapters=cfg.max_prompt_adapters,
                                   prompt_adapter_state=manager.prompts.state,
                                   reserved_prompt_slots=manager.prompts.reserved_slots,
                                   policy=cfg.scheduling_policy, fairness=VirtualTokenCounter(
                                       cfg.fairness_prefill_weight, cfg.fairness_decode_weight),
                                   grammar_state=grammar_state)
        if cfg.executor_backend == "uni":
            self.runner = self._make_runner(self.limits.num_kv_blocks, self.limits.max_model_len)
            if use_graphs:
                self.runner.capture_decode_graphs(manager.loras, cfg.max_lora_rank)
            self.executor = UniProcExecutor(self.runner)
        self.tokenizer = LazyTokenizer(self.model_dir)
        # decode looked up per call, so a tokenizer swapped on the engine (tests) is the one used
        self.output_processor = OutputProcessor(lambda ids, **options: self.tokenizer.decode(ids, **options),
                                                eos_token_ids(self.model_config, self.model_dir),
                                                self.limits.max_model_len)
        self.executor.eos_token_ids = self.output_processor.eos_token_ids  # the rows' min_tokens bans
        # encode looked up per call too, for the same reason
        self.inputs = InputProcessor(vocab_size=self.model_config.vocab_size, max_model_len=self.limits.max_model_len,
                                     max_logprobs=cfg.max_logprobs, encode=lambda text: self.tokenizer.encode(text),
                                     prompts_enabled=cfg.max_prompt_adapters > 0)
        # structured outputs: grammars compile off the step thread, for the tokenizer looked up when first needed
        self.structured = StructuredOutputs(lambda: self.tokenizer.get(), self.model_config.vocab_size,
                                            lambda: self.output_processor.eos_token_ids, wake=self.intake.wake,
                                            timeout_s=cfg.structured_outputs_compile_timeout_s)
        self._stepping = threading.Lock()  # held by the one thread inside step()
        self._arrivals = count()
        self._stats = EngineStats.collect(self.scheduler, self.block_manager, steps=0)

    def _start_in_process(self, cfg: EngineConfig, device: torch.device, dtype: torch.dtype):
        """The "uni" backend (tensor_parallel_size=1): the model, its adapter slots and the KV size in this
        process; (manager, whether decode steps use CUDA graphs). The runner is made once the adapter seam
        exists."""
        self.model, self.model_config, self.model_dir = load_model(
            cfg.model, revision=cfg.revision, dtype=dtype, device=device, local_files_only=cfg.local_files_only,
            quantization=cfg.quantization)
        manager = self._make_manager(device, lora_base_weights(self.model))
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        use_graphs = not cfg.enforce_eager and cuda_graphs_available(device)
        kv_budget = (self._profile_kv_budget(manager, use_graphs)
                     if device.type == "cuda" and cfg.kv_cache_memory_bytes is None else None)
        self.limits = engine_limits(cfg, self.model_config.max_position_embeddings,
                                    kv_block_bytes(self.model_config, 1, dtype), free, kv_budget,
                                    available_host_memory() if device.type == "cpu" else None)
        return manager, use_graphs

    def _start_workers(self, cfg: EngineConfig, device: torch.device, dtype: torch.dtype, threads: int):
        """The "mp" and "ray" backends (tensor_parallel_size > 1, or 1 when asked for): one worker process (or Ray
        actor) per rank
        holds its model, KV cache and slots; this process keeps the scheduler and the adapter tiers, whose slots are proxies (lora_runner.executor).
        ``threads``: the engine's CPU threads, split over the ranks."""
        if device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
            raise ValueError("tensor_parallel_size > 1 on CUDA needs kv_cache_memory_bytes (per rank): the "
                             "start-up memory profile runs in one process only")
        self.model, self.runner = None, None
        self.model_dir = resolve_model_dir(cfg.model, revision=cfg.revision, local_files_only=cfg.local_files_only)
        self.model_config = ModelConfig.from_dir(self.model_dir, name_or_path=cfg.model,
                                                 quantization=cfg.quantization)
        check_splits(self.model_config.spec(), cfg.tensor_parallel_size)  # ValueError before any process starts
        # a block on one rank (its KV heads); the host's memory holds every rank's blocks, a GPU one rank's
        rank_block = kv_block_bytes(self.model_config, 1, dtype, TensorParallel(0, cfg.tensor_parallel_size))
        self.limits = engine_limits(cfg, self.model_config.max_position_embeddings,
                                    rank_block * (cfg.tensor_parallel_size if device.type == "cpu" else 1), None,
                                    cfg.kv_cache_memory_bytes if device.type == "cuda" else None,
                                    available_host_memory() if device.type == "cpu" else None)
        _, max_batched, max_blocks_per_seq = step_sizes(cfg, self.model_config.max_position_embeddings,
                                                        self.limits.max_model_len)
        spec = WorkerSpec(
            model=cfg.model, revision=cfg.revision, local_files_only=cfg.local_files_only,
            quantization=cfg.quantization, dtype=dtype, device_type=device.type,
            num_kv_blocks=self.limits.num_kv_blocks, block_size=cfg.block_size, max_num_tokens=max_batched,
            max_num_seqs=cfg.max_num_seqs, max_blocks_per_seq=max_blocks_per_seq, max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank, max_prompt_adapters=cfg.max_prompt_adapters,
            max_prompt_adapter_tokens=cfg.max_prompt_adapter_tokens, seed=cfg.seed,
            eos_token_ids=eos_token_ids(self.model_config, self.model_dir),
            threads_per_rank=max(1, threads // cfg.tensor_parallel_size), step_timeout_s=cfg.worker_step_timeout_s,
            own_gpu_only=cfg.executor_backend == "ray")
        self.executor = _rank_executor(cfg.executor_backend)(spec, cfg.tensor_parallel_size)
        # DoRA's norms need whole rows of W, which no rank holds: read from the checkpoint (dequantized)
        manager = self._make_manager(torch.device("cpu"), checkpoint_base_weights(self.model_dir, self.model_config,
                                                                                  dtype),
                                     make_slots=self.executor.slot_proxy)
        return manager, False

    def _make_manager(self, device: torch.device, base_weight, make_slots=None) -> AdapterManager:
        """The adapter tiers; their weights live on `device` (the CPU when the slots are in worker processes)."""
        cfg = self.config
        return AdapterManager(
            self.model_config.spec(), max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
            max_cpu_loras=cfg.cpu_loras, max_prompt_adapters=cfg.max_prompt_adapters,
            max_prompt_adapter_tokens=cfg.max_prompt_adapter_tokens, device=device, dtype=cfg.torch_dtype(),
            allow_pickle=cfg.allow_pickle, local_files_only=cfg.local_files_only,
            max_adapter_bytes=cfg.max_adapter_bytes, on_load_done=self.intake.wake, base_weight=base_weight,
            make_slots=make_slots)

    def _make_runner(self, num_kv_blocks: int, max_model_len: int | None = None, *,
                     manager: AdapterManager | None = None) -> ModelRunner:
        """A runner over the adapter slots of `manager` (default: the engine's; the start-up memory
        profile runs before the engine's adapter seam exists)."""
        cfg, manager = self.config, manager or self.adapters.manager
        _, max_batched, max_blocks_per_seq = step_sizes(cfg, self.model_config.max_position_embeddings,
                                                            max_model_len)
        return ModelRunner(
            self.model, self.model_config, manager.lora_slots, num_kv_blocks=num_kv_blocks,
            block_size=cfg.block_size, max_num_tokens=max_batched, max_num_seqs=cfg.max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq, max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank,
            dtype=cfg.torch_dtype(), device=cfg.torch_device(), seed=cfg.seed,
            prompt_slots=manager.prompt_slots, vocab_slots=manager.vocab_slots)

    def _profile_kv_budget(self, manager: AdapterManager, use_graphs: bool) -> int:
        """CUDA start-up memory profile (lora_runner.worker.memory_profile): bytes left for the KV cache."""
        cfg = self.config
        max_model_len, max_batched, _ = step_sizes(cfg, self.model_config.max_position_embeddings)
        return profile_kv_cache_budget(
            partial(self._make_runner, manager=manager), manager.loras, max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank, max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            block_size=cfg.block_size, gpu_memory_utilization=cfg.gpu_memory_utilization, cuda_graphs=use_graphs)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a request (unless ignore_eos); settable, read by the output processor and
        banned by the runner's rows until min_tokens (running requests included, from their next step)."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.output_processor.eos_token_ids = self.executor.eos_token_ids = frozenset(ids)

    # ----------------------------------------------------------------------------- intake (any thread)
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None,
                    prompt_adapter_request: PromptAdapterRequest | None = None, *,
                    tenant: str | None = None, cache_salt: str | None = None) -> None:
        """Queue a request. Its adapters start loading in the background now.

        prompt: a string (tokenized with the model dir's tokenizer) or a list of token ids.
        prompt_adapter_request: a soft prompt put in front of the prompt (may be combined with a LoRA).
        tenant: whom fair admission (scheduling_policy="fair") accounts the request to; None: its
        LoRA's name, else its prompt adapter's name, else "" (one tenant for the base model).
        cache_salt: part of every prefix-cache key of the request (lora_runner.core.prefix_cache):
        requests with different salts never share cached KV (the server salts by tenant key).
        params: checked again here with the engine's limits (max_logprobs, the vocabulary) and
        copied, so changing the caller's object later does not affect the request.
        Raises ValueError, before touching any state, for a request id that is not a string or is
        in use, bad params, an empty prompt, a prompt longer than max_model_len (virtual tokens
        included, when the prompt adapter is loaded already), token ids outside the vocabulary, a
        string prompt when the model has no tokenizer, or a prompt adapter when they are disabled.
        An adapter that fails to load does not raise here: that request finishes with "error".
        EngineDeadError once a tensor-parallel worker died (is_alive is False).
        params.n > 1: n samples (lora_runner.engine.parallel_sampling) that share the prompt's prefill,
        reported as one RequestOutput with n CompletionOutputs; their internal ids
        f"{request_id}[i]" are taken too while it runs; abort_request(request_id) aborts them all.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine can serve no more requests: {self._dead}")
        samples = self.inputs.sample_requests(request_id, prompt, params, lora_request, prompt_adapter_request,
                                              tenant, self._new_request, cache_salt)
        with self.intake.adding(request_id, samples):  # ids reserved now; queued once the adapters are held
            self._acquire_all(samples)

    def _new_request(self, request_id: str, token_ids: list[int], params: SamplingParams, prompt, lora_request,
                     prompt_adapter_request, tenant, cache_salt) -> Request:
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(params.bad_words, self.tokenizer.get(),
                                                             self.model_config.vocab_size)
        grammar = self.structured.request_grammar(params)  # its own matcher; the compilation is shared
        generator = self.executor.make_generator(params.seed) if params.seed is not None else None
        request = Request(request_id, list(token_ids), params, arrival=next(self._arrivals),
                          prompt=prompt if isinstance(prompt, str) else None, lora_request=lora_request,
                          prompt_adapter_request=prompt_adapter_request, generator=generator, tenant=tenant,
                          cache_salt=cache_salt)
        request.grammar = grammar
        return request

    def _acquire_all(self, samples: list[Request]) -> None:
        """Acquire every sample's adapters, all or nothing."""
        acquired = []
        try:
            for request in samples:
                self.adapters.acquire(request)  # all or nothing for one request
                acquired.append(request)
        except BaseException:
            for request in acquired:
                self.adapters.release(request)
            raise

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests by id (unknown ids are ignored); the next step() reports them as "abort".

        ValueError unless request_id is a string or an iterable of strings."""
        self.intake.abort(abort_ids(request_id))

    def close(self) -> None:
        """Cancel background adapter loads and stop the loader threads; returns at once, even while
        a download is stalled (its daemon thread never delays process exit). Requests whose loads
        were cancelled finish with "error" at the next step(); requests with ready adapters can
        still be stepped to completion. From now on add_request, add_lora, add_prompt_adapter and
        pin/unpin/remove raise EngineClosedError. Idempotent.
        At tensor_parallel_size > 1 it also stops the worker processes (none is left running), so the
        requests still unfinished finish with "error" at the next step()."""
        self.intake.close()
        self.adapters.close()
        self.structured.close()
        self.executor.close()
        self.intake.wake()  # the cancelled loads are failures the next step reports

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a step could make progress: returns at once unless the last step() found
        nothing to run (every request waiting for an adapter load); then waits until a load
        finishes, a request is added or aborted, or the engine is closed. Returns False on timeout.
        Loops on step() call this between steps instead of spinning."""
        return self.intake.wait_for_work(timeout)

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def is_alive(self) -> bool:
        """False once the executor died (a tensor-parallel worker exited or did not answer a step in time);
        the server's /health reads it through AsyncLLMEngine.is_running."""
        return self._dead is None and self.executor.is_alive()

    def has_unfinished_requests(self) -> bool:
        """True while any added request has not been reported finished."""
        return self.intake.has_unfinished()

    # ----------------------------------------------------------------------------- adapters (any thread)
    # add_lora, pin_prompt_adapter, serve_adapter, ... come from AdapterAPI (lora_runner.engine.adapter_api),
    # each one call on the seam, EngineAdapters (lora_runner.engine.adapters).
    def _adapter_seam(self, check_open: bool = True) -> EngineAdapters:
        """The engine's EngineAdapters (AdapterAPI's hook); with ``check_open``, EngineClosedError after close()."""
        if check_open:
            self.intake.check_open()
        return self.adapters

    # ----------------------------------------------------------------------------- the step loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns the outputs of requests that progressed or finished.

        One thread at a time may step (the other methods may be called from any thread meanwhile);
        RuntimeError if another thread is inside step() already.
        """
        if not self._stepping.acquire(blocking=False):
            raise RuntimeError("LLMEngine.step() is already running in another thread; call it from one thread")
        try:
            outputs = self._merge_samples(self._step())
            self._publish_stats()
            return outputs
        finally:
            self._stepping.release()

    def _publish_stats(self) -> None:
        """Swap in this step's EngineStats (one reference: readers on other threads see the whole old
        snapshot or the whole new one)."""
        self._stats = EngineStats.collect(self.scheduler, self.block_manager, steps=self._stats.steps + 1)

    @property
    def stats(self) -> EngineStats:
        """The snapshot of the latest step, safe to read from any thread; its adapter counters are
        read now (adapters also load between steps, and the manager's counters have their own lock)."""
        return dataclasses.replace(self._stats, adapters=self.adapters.manager.stats)

    def _merge_samples(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """One RequestOutput per request with n > 1 (lora_runner.engine.parallel_sampling)."""
        return self.intake.merge_samples(outputs)

    def _step(self) -> list[RequestOutput]:
        if self._dead is not None:  # requests that slipped in while the executor died
            return self._fail_everything(self._dead)
        wakes_at_start = self.intake.step_began()
        outputs = self._take_intake()
        self._insert_placeholders()
        with self.adapters.step_lock:  # a pin from another thread must not take a slot this step counted on
            sched = self.scheduler.schedule()
            # the rows of requests that left go now, whatever happens to the rest of this step (the
            # output hands their ids over once; InputBatch.update frees them again, a no-op then)
            self.executor.forget(sched.left_ids)
            slot_of, prompt_slot_of, unplaced = self._activate(sched)
        idle = not (outputs or sched.failed or sched.scheduled)
        self.intake.step_ended(wakes_at_start if idle else None)
        outputs += self._fail_unplaced(sched, unplaced)
        for request in sched.failed:
            error = request.error or self.adapters.failure(request)
            logger.warning("request %r failed: %s", request.request_id, error)
            outputs.append(self._finish(request, "error", error))
        if sched.scheduled:
            now = time.monotonic()  # for the latency metrics (RequestTimes)
            for scheduled in sched.scheduled:
                scheduled.request.times.scheduled(now)
            outputs += self._run(sched, slot_of, prompt_slot_of)
        return outputs

    def _activate(self, sched: SchedulerOutput) -> tuple[dict, dict, dict[Request, BaseException]]:
        """The step's adapters made resident: (LoRA slots, prompt slots, requests that must leave the step
        with their error). An adapter whose slot write raised fails its own requests only; any other
        failure here fails the whole step's requests, before their rows reach the runner (whose rows
        would otherwise miss this step's block diffs)."""
        try:
            slot_of, prompt_slot_of = self.adapters.activate(sched.scheduled)
        except Exception as error:  # noqa: BLE001 - the step's requests fail; the step loop goes on
            logger.exception("making the step's adapters resident failed; failing its %d requests",
                             len(sched.scheduled))
            return {}, {}, {s.request: error for s in sched.scheduled}
        return slot_of, prompt_slot_of, self.adapters.unplaced(sched.scheduled, slot_of, prompt_slot_of)

    def _fail_unplaced(self, sched: SchedulerOutput, unplaced: dict[Request, BaseException]) -> list[RequestOutput]:
        """Take ``unplaced`` requests out of the step (and their rows out of the runner), finished with their error."""
        if not unplaced:
            return []
        ids = {request.request_id for request in unplaced}
        kept = [i for i, request_id in enumerate(sched.scheduled_ids) if request_id not in ids]
        sched.scheduled = [sched.scheduled[i] for i in kept]
        sched.scheduled_ids = [sched.scheduled_ids[i] for i in kept]
        sched.num_scheduled_tokens = [sched.num_scheduled_tokens[i] for i in kept]
        sched.new_requests = [new for new in sched.new_requests if new.request_id not in ids]
        sched.continuing = [cont for cont in sched.continuing if cont.request_id not in ids]
        self.executor.forget(ids)
        for request, error in unplaced.items():
            logger.warning("request %r failed: %s", request.request_id, error)
        return [self._finish(request, "error", error) for request in unplaced]

    def _take_intake(self) -> list[RequestOutput]:
        """Hand the requests added since the last step to the scheduler; finish those aborted."""
        new, aborts = self.intake.take()
        for request, leader in new:
            self.scheduler.add(request, leader)
        return [self._finish(request, "abort") for request in aborts
                if not request.is_finished]  # it may have finished since the abort was asked for

    def _run(self, sched: SchedulerOutput, slot_of: dict, prompt_slot_of: dict) -> list[RequestOutput]:
        # the runner keeps each running request's state in a row, its sampling settings included:
        # the output says what changed; the structured-output mask is filled here, on the step thread
        sched.grammar_rows, sched.grammar_bitmask = self.structured.step_bitmask(
            [s.request for s in sched.scheduled if s.samples])
        try:
            result = self.executor.execute(sched, slot_of, prompt_slot_of)
        except EngineDeadError as error:
            return self._fail_everything(error)
        return [self._report(request, error)
                for request, error in self.scheduler.postprocess(sched.scheduled, result, self.output_processor)]

    def _fail_everything(self, error: EngineDeadError) -> list[RequestOutput]:
        """The executor died (a worker exited or hung): every request the engine holds finishes with
        "error" now, and from now on add_request raises EngineDeadError and is_alive is False."""
        if self._dead is None:
            logger.error("the engine can serve no more requests: %s", error)
        self._dead = error
        outputs = self._take_intake()  # requests added since the last step join the scheduler first
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            outputs.append(self._finish(request, "error", error))
        return outputs

    def _report(self, request: Request, error: BaseException | None) -> RequestOutput:
        """A sampled request's output after Scheduler.postprocess; a finished one gives its adapters
        back, a failed one (its own sampling, stop check or detokenization raised) finishes with
        "error" alone: the others in the step go on with their tokens."""
        if error is not None:
            logger.warning("request %r failed in step: %r", request.request_id, error)
            return self._finish(request, "error", error)
        if request.is_finished:
            self._release(request)
        return self._output(request)

    def _insert_placeholders(self) -> None:
        """Soft-prompt placeholders for waiting requests whose prompt adapter is loaded; one whose
        insertion raises gets that error, and the scheduler hands it back to fail alone."""
        for request in list(self.scheduler.waiting):
            try:
                self.adapters.insert_virtual_tokens([request])
            except Exception as error:  # this request's placeholders could not be made; it alone fails
                logger.warning("request %r: soft-prompt placeholders failed: %r", request.request_id, error)
                request.error = error

    def _finish(self, request: Request, reason: str, error: BaseException | None = None) -> RequestOutput:
        request.finish(reason, error)
        self.scheduler.remove(request)
        self._release(request)
        return self._output(request)

    def _release(self, request: Request) -> None:
        """A finished request gives back its adapters and stops being live."""
        self.adapters.release(request)
        self.intake.finished(request)

    def _output(self, request: Request) -> RequestOutput:
        """The request's RequestOutput (its text and the text since its previous output)."""
        completion = self.output_processor.completion(request)
        now = time.monotonic()
        request.times.tokens(len(request.output_token_ids), now)
        if request.is_finished and request.times.finished is None:
            request.times.finished = now
        return RequestOutput(request.request_id, request.prompt_token_ids, [completion],
                             finished=request.is_finished, prompt=request.prompt,
                             num_cached_tokens=request.num_cached_tokens, prompt_logprobs=request.prompt_logprobs,
                             metrics=dataclasses.replace(request.times))



def _rank_executor(backend: str) -> type:
    """The executor class of a backend with one worker per rank: "mp" or "ray"."""
    if backend == "ray":
        # imported here: Ray is an optional dependency (lora-runner[ray]), needed only by this backend
        from lora_runner.executor.ray_executor import RayExecutor

        return RayExecutor
    return MultiprocExecutor
