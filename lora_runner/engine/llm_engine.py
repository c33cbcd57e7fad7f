"""LLMEngine: requests in, one continuously batched step at a time, RequestOutputs out.

``step()`` = the intake's new requests and aborts join the scheduler, then five calls:
scheduler.schedule() (it asks the adapter seam to make the picked requests' LoRAs and soft prompts
resident, and leaves out those that got no slot) -> the step's grammar mask (GrammarOutput) ->
executor.execute() (forward and sample) -> update: scheduler.postprocess() (append tokens, detokenize
incrementally, stop checks: lora_runner.engine.output_processor; finish requests, free blocks),
release adapters, outputs. Adapters load in the background (acquired at add_request); the scheduler
only admits requests whose adapters are ready, so a slow download never stalls running requests.
Both adapter kinds go through one seam, lora_runner.engine.adapters (which also describes prompt
adapters as placeholder tokens); pins and load state live in the adapter tiers only.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from itertools import count

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.config import EngineConfig
from lora_runner.core.block_manager import BlockManager
from lora_runner.core.fairness import VirtualTokenCounter, tenant_of
from lora_runner.core.request import Request
from lora_runner.core.scheduler import Scheduler
from lora_runner.core.scheduler_output import GrammarOutput, SchedulerOutput
from lora_runner.device import set_cpu_threads
from lora_runner.engine.adapter_api import AdapterAPI
from lora_runner.engine.adapters import EngineAdapters
from lora_runner.engine.bad_words import bad_words_token_ids
from lora_runner.engine.errors import EngineDeadError
from lora_runner.engine.input_processor import InputProcessor, abort_ids
from lora_runner.engine.intake import Intake
from lora_runner.engine.output_processor import OutputProcessor
from lora_runner.engine.stats import EngineStats
from lora_runner.engine.structured import StructuredOutputs, grammar_state
from lora_runner.engine.tokenizer import LazyTokenizer, eos_token_ids
from lora_runner.executor.draft_budget import draft_lora_settings
from lora_runner.executor.startup import start_executor
from lora_runner.outputs import RequestOutput
from lora_runner.sample.sampler import SamplerOutput
from lora_runner.sampling_params import SamplingParams
from lora_runner.spec_decode.adaptive import SpeculationPolicy
from lora_runner.spec_decode.grammar_masks import position_bitmask
from lora_runner.spec_decode.ngram import Speculator
from lora_runner.worker.draft_runner import load_draft_speculator

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
        threads = (set_cpu_threads(cfg.cpu_threads) if cfg.torch_device().type == "cpu" or cfg.cpu_threads is not None
                   else 1)
        started = start_executor(cfg, threads, on_load_done=self.intake.wake)
        self.executor, self.limits = started.executor, started.limits
        self.model_config, self.model_dir = started.model_config, started.model_dir
        self.model, self.runner = started.model, started.runner  # in this process only (else None)
        self._loaded_draft = started.draft  # a draft model start-up loaded (counted in its memory), else None
        manager = started.manager
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
                                   grammar_state=grammar_state, speculator=self._speculator())
        # add_lora validates a LoRA's draft adapter too (the draft_model method's per-request adapters)
        self.adapters.draft_adapters = getattr(getattr(self.scheduler.speculator, "proposer", None), "adapters", None)
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
                                            timeout_s=cfg.structured_outputs_compile_timeout_s,
                                            tenant_bytes=cfg.structured_outputs_tenant_cache_bytes,
                                            total_bytes=cfg.structured_outputs_cache_bytes,
                                            mask_budget_s=cfg.structured_outputs_mask_budget_ms / 1000,
                                            step_budget_s=cfg.structured_outputs_step_mask_budget_ms / 1000,
                                            backend=cfg.structured_outputs_backend)
        self._stepping = threading.Lock()  # held by the one thread inside step()
        self._arrivals = count()
        self._stats = EngineStats.collect(self.scheduler, self.block_manager, steps=0)

    def _speculator(self) -> SpeculationPolicy | None:
        """The scheduler's draft-token source when speculative decoding is on (README: Speculative decoding):
        n-gram lookup, or a draft model that runs in this process (at tensor_parallel_size > 1 too, unsharded),
        behind the policy that decides who proposes (spec_decode.adaptive)."""
        spec, cfg = self.config.speculative(), self.config
        if spec is None:
            return None
        if spec.method == "ngram":
            return SpeculationPolicy(Speculator(spec, self.limits.max_model_len), spec)
        try:
            return SpeculationPolicy(load_draft_speculator(
                spec, target_config=self.model_config, target_dir=self.model_dir,
                vocab_of=lambda model_dir: LazyTokenizer(model_dir).vocab(),
                max_model_len=self.limits.max_model_len, max_num_batched_tokens=self.limits.max_num_batched_tokens,
                max_num_seqs=cfg.max_num_seqs, num_kv_blocks=self.limits.num_kv_blocks, block_size=cfg.block_size,
                dtype=cfg.torch_dtype(), device=cfg.torch_device(), local_files_only=cfg.local_files_only,
                loaded=self._loaded_draft, target_graphs=self.runner.decode_graphs if self.runner else None,
                draft_loras=draft_lora_settings(cfg)), spec)
        except BaseException:  # a draft refused or not found: no worker process outlives the failed start
            self.executor.close()
            raise

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
        generator = self.executor.make_generator(params.seed) if params.seed is not None else None
        request = Request(request_id, list(token_ids), params, arrival=next(self._arrivals),
                          prompt=prompt if isinstance(prompt, str) else None, lora_request=lora_request,
                          prompt_adapter_request=prompt_adapter_request, generator=generator, tenant=tenant,
                          cache_salt=cache_salt)
        # its own matcher; the compilation is queued, cached and bounded per tenant
        request.grammar = self.structured.request_grammar(params, tenant_of(request))
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
        if self.scheduler.speculator is not None:  # a draft model's adapter loads
            self.scheduler.speculator.close()
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
        """One step: the intake's requests and aborts join the scheduler, then five calls: schedule (which
        has the picked requests' adapters made resident, and leaves out those that got no slot) -> the
        grammar mask -> execute (forward and sample) -> update (tokens appended, stops, outputs). The
        SchedulerOutput is never edited after schedule()."""
        if self._dead is not None:  # requests that slipped in while the executor died
            return self._fail_everything(self._dead)
        wakes_at_start = self.intake.step_began()
        outputs = self._take_intake()
        sched = self._schedule()
        idle = not (outputs or sched.failed or sched.scheduled)
        self.intake.step_ended(wakes_at_start if idle else None)
        outputs += [self._fail(request) for request in sched.failed]
        if not sched.scheduled:
            return outputs
        grammar = self._grammar(sched)
        try:
            result = self.executor.execute(sched, grammar)
        except EngineDeadError as error:
            return outputs + self._fail_everything(error)
        return outputs + self._update(sched, result)

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's decision, its adapters made resident under the adapter lock (a pin from another
        thread must not take a slot the step counted on). The rows of requests that left go now, whatever
        happens to the rest of the step (the output hands their ids over once)."""
        self._insert_placeholders()
        with self.adapters.step_lock:
            sched = self.scheduler.schedule(place=self.adapters.place)
        self.executor.forget(sched.left_ids)
        now = time.monotonic()  # for the latency metrics (RequestTimes)
        for scheduled in sched.scheduled:
            scheduled.request.times.scheduled(now)
        return sched

    def _grammar(self, sched: SchedulerOutput) -> GrammarOutput | None:
        """The step's structured-output mask over its sampled rows (filled on the step thread); None when
        no row is constrained. With draft tokens its rows are the verified positions (spec_decode.grammar_masks)."""
        sampled = [s for s in sched.scheduled if s.samples]
        if sched.scheduled_spec_decode_tokens:
            rows, bitmask = position_bitmask([s.request for s in sampled], [s.draft_token_ids for s in sampled],
                                             self.structured.vocab_size, self.structured.mask_budget_s)
        else:
            rows, bitmask = self.structured.step_bitmask([s.request for s in sampled])
        return None if bitmask is None else GrammarOutput(tuple(rows), bitmask)

    def _update(self, sched: SchedulerOutput, result: SamplerOutput) -> list[RequestOutput]:
        """The step's tokens appended (Scheduler.postprocess: stops, detokenizing, finished requests
        removed), then one output per sampled request."""
        return [self._report(request, error)
                for request, error in self.scheduler.postprocess(sched.scheduled, result, self.output_processor)]

    def _fail(self, request: Request) -> RequestOutput:
        """A request the scheduler handed back failed: its own error, or its adapter's load error."""
        error = request.error or self.adapters.failure(request)
        logger.warning("request %r failed: %s", request.request_id, error)
        return self._finish(request, "error", error)

    def _take_intake(self) -> list[RequestOutput]:
        """Hand the requests added since the last step to the scheduler; finish those aborted."""
        new, aborts = self.intake.take()
        for request, leader in new:
            self.scheduler.add(request, leader)
        return [self._finish(request, "abort") for request in aborts
                if not request.is_finished]  # it may have finished since the abort was asked for

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
        """A finished request gives back its adapters (and its grammar's compilation) and stops being live."""
        self.adapters.release(request)
        self.intake.finished(request)
        if request.grammar is not None:  # a compilation nobody waits for any more is not started
            request.grammar.release()

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
                             metrics=dataclasses.replace(request.times), lora_version=request.adapter_versions[0],
                             prompt_adapter_version=request.adapter_versions[1],
                             spec_decode=(None if self.scheduler.speculator is None
                                          else dataclasses.replace(request.spec,
                                                                   accepted_per_position=list(
                                                                       request.spec.accepted_per_position))))


