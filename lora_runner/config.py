"""Engine configuration: what the user sets, validated on construction (the runtime sizes derived
from it and the model are lora_runner.executor.limits)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lora_runner.core.fairness import DEFAULT_DECODE_WEIGHT, DEFAULT_PREFILL_WEIGHT, POLICIES, check_weight
from lora_runner.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:  # torch (and the model package) load when a config is built, not with `serve --help`
    import torch

# a grammar (structured_outputs) still compiling after this long fails its request; bounded so that a hostile
# constraint cannot hold a request (and its tenant's seat) for long, nor be failed before a real schema compiles
MAX_COMPILE_TIMEOUT_S = 600.0


def _doc(text: str, **default) -> dict:
    """A field's default plus its description (``metadata["help"]``: the one place a setting is
    described; the ``serve`` options are generated from these, lora_runner.entrypoints.engine_args)."""
    return {**default, "metadata": {"help": text}}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the user chooses about an engine; validated on construction (ValueError).

    Each field's description is its ``metadata["help"]`` (``dataclasses.fields(EngineConfig)``).
    """

    model: str = field(**_doc("base model: a local directory or a Hugging Face Hub repo id"))
    revision: str | None = field(**_doc("the model's Hub branch, tag or commit", default=None))
    quantization: str | None = field(**_doc(
        'quantize a bf16/fp16/fp32 checkpoint at load: "fp8" (per-output-channel FP8 weights, as vLLM\'s online '
        'FP8) or None; checkpoints that are already quantized (compressed-tensors, GPTQ, AWQ) are detected from '
        'their config.json without it', default=None))
    max_loras: int = field(**_doc("LoRA device slots (distinct LoRAs per step)", default=4))
    max_lora_rank: int = field(**_doc("largest LoRA rank accepted", default=16))
    max_cpu_loras: int | None = field(**_doc("LoRAs kept in CPU memory (None: max(16, max_loras))", default=None))
    max_cpu_lora_bytes: int | None = field(**_doc(
        "bytes the LoRAs kept in CPU memory may hold (their tensors' real bytes), least recently used evicted "
        "first; an adapter larger than this alone is refused (None: max_cpu_loras adapters of the largest size at "
        "max_lora_rank, so max_cpu_loras binds first; logged at start). On CPU it comes off the RAM the KV cache "
        "is sized from: always with worker processes (the mp and ray backends), in the engine's own process only "
        "when set (the default is an upper bound real adapters seldom reach)", default=None))
    max_memory_adapter_bytes: int | None = field(**_doc(
        "bytes the snapshots of LoRAs handed over in memory (update_lora, POST /v1/lora_adapters/{name}/versions) "
        "may hold together: the served versions' and those running requests still finish on; an update past it "
        "is refused before it is copied. When the server's keys name several tenants, each tenant's adapters' "
        "snapshots may hold --max-tenant-share of it (HTTP 429 over it; operator keys and the Python API: the "
        "whole bound) (None: max(max_cpu_lora_bytes, 4 x max_adapter_bytes); logged at start)", default=None))
    max_prompt_adapters: int = field(**_doc("soft-prompt device slots (0 = prompt adapters off)", default=0))
    max_prompt_adapter_tokens: int = field(**_doc("most virtual tokens of one soft prompt (0 = off)", default=0))
    max_cpu_prompt_adapter_bytes: int | None = field(**_doc(
        "bytes the prompt adapters (soft prompts) kept in CPU memory may hold (their tensors' real bytes), least "
        "recently used evicted first; a soft prompt larger than this alone is refused; a bound of its own, beside "
        "max_cpu_lora_bytes, so soft prompts never evict LoRAs nor LoRAs soft prompts (None: as many soft prompts "
        "as the prompt CPU cache counts, max(max_cpu_loras, max_prompt_adapters), of max_prompt_adapter_tokens "
        "each, so the count binds first; logged at start)", default=None))
    device: str = field(**_doc('"auto" (cuda if available, else cpu), "cpu" or "cuda[:i]"', default="auto"))
    dtype: str | torch.dtype = field(**_doc('"auto" (bf16 on CUDA, fp32 on CPU), a name ("float32", "bfloat16", '
                                            '"float16") or a torch.dtype', default="auto"))
    max_num_seqs: int = field(**_doc("requests running at once", default=64))
    max_model_len: int | None = field(**_doc(
        "prompt + generated tokens per request (None: the model's max_position_embeddings on CPU, lowered "
        "when one such request does not fit the CPU KV budget; min(2048, it) on CUDA; a larger explicit "
        "value is an error)", default=None))
    max_num_batched_tokens: int | None = field(**_doc(
        "tokens per step; longer prompts are prefilled in chunks (None: max(min(max_model_len, 8192; 2048 "
        "on CPU), max_num_seqs))", default=None))
    block_size: int = field(**_doc("tokens per KV block", default=16))
    kv_cache_memory_bytes: int | None = field(**_doc(
        "KV-cache budget (None: enough for max_num_seqs full-length requests, bounded on CPU by a quarter "
        "of the RAM available at start-up and 4 GiB (lora_runner.worker.kv_budget; the CPU cache takes RAM "
        "only as blocks are first used) and, on CUDA, by what the start-up memory profile leaves under "
        "gpu_memory_utilization, see lora_runner.worker.memory_profile); per rank with tensor_parallel_size > 1 "
        "on CUDA; a speculative draft model's KV cache shares it (lora_runner.executor.draft_budget); the "
        "chosen size and why are logged at INFO", default=None))
    enable_prefix_caching: bool = field(**_doc(
        "keep the KV of full prompt blocks after their requests finish and reuse it for later requests "
        "with the same prefix, LoRA version, prompt-adapter version and cache salt (lora_runner.core."
        "prefix_cache); cached blocks are evicted, least recently used first, when memory is needed",
        default=True))
    enforce_eager: bool = field(**_doc("never use CUDA graphs (else decode steps replay graphs on CUDA, see "
                                       "lora_runner.worker.cuda_graphs)", default=False))
    gpu_memory_utilization: float = field(**_doc(
        "the fraction of the CUDA device's memory the engine may use (weights, activations, graphs and "
        "the KV cache), in (0, 1]", default=0.9))
    seed: int = field(**_doc("the sampling seed of requests without their own seed", default=0))
    allow_pickle: bool = field(**_doc("also read adapter_model.bin adapter weights (torch.load with "
                                      "weights_only=True)", default=False))
    local_files_only: bool | None = field(**_doc("never use the network for the model and adapters (None: "
                                                 "follow HF_HUB_OFFLINE)", default=None))
    max_adapter_bytes: int | None = field(**_doc(
        "refuse adapter files larger than this, checked before reading (None: the largest file a valid "
        "adapter of this model at max_lora_rank can be, in float32: adapters.file_limits)", default=None))
    max_logprobs: int = field(**_doc(
        "the most logprobs (SamplingParams.logprobs) one request may ask for (as in vLLM; -1: no cap, so "
        "logprobs=-1 may ask for the whole vocabulary); a request over it is refused with ValueError at "
        "add_request", default=20))
    scheduling_policy: str = field(**_doc(
        f'one of {POLICIES}: "fair" admits the least-served tenant first (Virtual Token Counter, see '
        'lora_runner.core.fairness), "fcfs" in arrival order', default="fair"))
    fairness_prefill_weight: float = field(**_doc("the fair policy's price of one prompt token",
                                                  default=DEFAULT_PREFILL_WEIGHT))
    fairness_decode_weight: float = field(**_doc("the fair policy's price of one generated token",
                                                 default=DEFAULT_DECODE_WEIGHT))
    cpu_threads: int | None = field(**_doc(
        "torch intra-op threads, set with torch.set_num_threads when the engine starts (process-global: it "
        "applies to everything else in the process too); None: on CPU the physical cores available to the "
        "process (affinity mask, SMT, cgroup quota), never more than torch's current setting, and on CUDA "
        "untouched", default=None))

    tensor_parallel_size: int = field(**_doc(
        "split the model over this many ranks, one worker process each (torch.distributed: gloo on CPU, nccl "
        "on CUDA, where rank r uses cuda:r); 1 runs the model in the engine's process (README: Tensor "
        "parallelism)", default=1))
    distributed_executor_backend: str | None = field(**_doc(
        'how the model runs: "uni" (in the engine\'s process; tensor_parallel_size 1 only), "mp" (one worker '
        'process per rank, started with torch.multiprocessing), "ray" (one Ray actor per rank in a placement group '
        'of one bundle per rank, on the engine\'s node; needs lora-runner[ray]) or None ("uni" at '
        'tensor_parallel_size 1, else "mp")', default=None))
    worker_step_timeout_s: float = field(**_doc(
        "at tensor_parallel_size > 1: seconds a step may take before the workers are declared dead (every "
        "request then finishes with \"error\" and the engine stops serving)", default=120.0))
    structured_outputs_compile_timeout_s: float = field(**_doc(
        "seconds a request's structured-output constraint (JSON schema, regex, grammar) may take to compile "
        f"before the request fails with StructuredOutputError (HTTP 400); in (0, {MAX_COMPILE_TIMEOUT_S:g}]",
        default=30.0))
    structured_outputs_cache_bytes: int = field(**_doc(
        "bytes of compiled structured-output grammars the server keeps, all tenants together, compilations still "
        "in flight included (estimated until compiled); the least recently used are dropped first, and a new "
        "constraint that does not fit beside those still compiling fails with StructuredOutputError (HTTP 400)",
        default=1 << 30))
    structured_outputs_tenant_cache_bytes: int = field(**_doc(
        "bytes of compiled structured-output grammars one tenant may hold (in flight included), and of its live "
        "constrained requests' matchers (an estimate each); a tenant over it "
        "loses its own least recently used first, and one grammar bigger than this fails its request with "
        "StructuredOutputError (HTTP 400); at most structured_outputs_cache_bytes", default=256 << 20))
    structured_outputs_mask_budget_ms: float = field(**_doc(
        "milliseconds (of the step thread's CPU time) one request's structured-output token mask may take to "
        "compute in a step; a request over it finishes alone with \"error\" (StructuredOutputError), so an "
        "ambiguous grammar cannot slow every step for everyone", default=250.0))
    structured_outputs_step_mask_budget_ms: float = field(**_doc(
        "milliseconds (of the step thread's CPU time) the structured-output token masks of all requests together "
        "may take in one step; over it, the slowest requests of that step finish with \"error\" "
        "(StructuredOutputError) until the others' masks fit, so many constraints each under "
        "structured_outputs_mask_budget_ms cannot slow every step together", default=500.0))
    structured_outputs_backend: str = field(**_doc(
        'what compiles and enforces structured outputs: "xgrammar", "guidance" (llguidance, whose work per token '
        'is also bounded by its parser limits, set from structured_outputs_mask_budget_ms; reads Lark grammars) '
        'or "auto" (guidance where llguidance is installed, else xgrammar)', default="auto"))
    speculative_config: dict | str | None = field(hash=False, **_doc(
        'speculative decoding, in vLLM\'s spelling (a dict, or its JSON text on the command line): {"method": '
        '"ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b} verifies up to k '
        'tokens per decoding sequence and step, proposed from its own prompt and output; {"method": "draft_model", '
        '"model": PATH_OR_HUB_ID, "num_speculative_tokens": k} proposes a smaller model\'s greedy tokens (the same '
        'tokenizer; README: Speculative decoding); None: off', default=None))
    batch_invariant: bool = field(**_doc(
        "a request's tokens and logprobs are bitwise identical whether it runs alone or beside any other requests, "
        "adapters, chunk sizes and batch sizes (CPU: fixed-shape GEMM blocks, per-token attention and LoRA; CUDA: "
        "fixed-config Triton GEMM, RMSNorm and attention, LoRA shrink unsplit, tensor_parallel_size <= 2; README: "
        "Adapter versions and RL loops), at a cost in speed; unquantized models only", default=False))

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a local directory or a Hub repo id, got {self.model!r}")
        for name in ("max_loras", "max_lora_rank", "max_num_seqs", "block_size"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("max_prompt_adapters", "max_prompt_adapter_tokens"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("max_logprobs", self.max_logprobs, minimum=-1)  # -1: no cap (vLLM's)
        for name in ("max_cpu_loras", "max_model_len", "max_num_batched_tokens",
                     "kv_cache_memory_bytes", "max_adapter_bytes", "cpu_threads", "max_cpu_lora_bytes",
                     "max_memory_adapter_bytes", "max_cpu_prompt_adapter_bytes"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                             f"({self.max_loras}): every adapter on the device is also kept on the CPU")
        if (self.max_prompt_adapters > 0) != (self.max_prompt_adapter_tokens > 0):
            raise ValueError("set both max_prompt_adapters and max_prompt_adapter_tokens > 0 to enable "
                             "prompt adapters, or leave both 0")
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        for name in ("fairness_prefill_weight", "fairness_decode_weight"):
            check_weight(name, getattr(self, name))
        from lora_runner.model.quant.config import ONLINE_METHODS as QUANTIZATION_OPTIONS

        if self.quantization is not None and self.quantization not in QUANTIZATION_OPTIONS:
            raise ValueError(f"quantization must be None or one of {QUANTIZATION_OPTIONS}, got {self.quantization!r} "
                             "(a checkpoint already quantized with compressed-tensors, GPTQ or AWQ is detected from "
                             "its config.json: leave quantization None)")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError(f'distributed_executor_backend must be None, "uni", "mp" or "ray", got '
                             f'{self.distributed_executor_backend!r}')
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError('distributed_executor_backend="ray" needs Ray: pip install -e ".[ray]" in the '
                             'lora-runner checkout (or use "mp")')
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError('distributed_executor_backend="uni" runs one process: it needs tensor_parallel_size=1, '
                             f'got {self.tensor_parallel_size} (use "mp")')
        timeout = self.worker_step_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"worker_step_timeout_s must be a positive number of seconds, got {timeout!r}")
        compile_timeout = self.structured_outputs_compile_timeout_s
        if isinstance(compile_timeout, bool) or not isinstance(compile_timeout, (int, float)) \
                or not 0 < compile_timeout <= MAX_COMPILE_TIMEOUT_S:
            raise ValueError(f"structured_outputs_compile_timeout_s must be a number of seconds in "
                             f"(0, {MAX_COMPILE_TIMEOUT_S:g}], got {compile_timeout!r}")
        for name in ("structured_outputs_cache_bytes", "structured_outputs_tenant_cache_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
        if self.structured_outputs_tenant_cache_bytes > self.structured_outputs_cache_bytes:
            raise ValueError(f"structured_outputs_tenant_cache_bytes ({self.structured_outputs_tenant_cache_bytes}) "
                             f"must be at most structured_outputs_cache_bytes ({self.structured_outputs_cache_bytes})")
        for name in ("structured_outputs_mask_budget_ms", "structured_outputs_step_mask_budget_ms"):
            budget = getattr(self, name)
            if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0:
                raise ValueError(f"{name} must be a positive number of milliseconds, got {budget!r}")
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise ValueError('structured_outputs_backend must be "auto", "xgrammar" or "guidance", got '
                             f'{self.structured_outputs_backend!r}')
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # validates it
            if isinstance(self.speculative_config, str):  # JSON text (the command line) is kept as its dict
                object.__setattr__(self, "speculative_config", json.loads(self.speculative_config))
        self.torch_device()  # validates device
        self.torch_dtype()  # validates dtype
        self.check_parallel()
        self._check_batch_invariant()

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config checked and typed; None when speculative decoding is off."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @property
    def cpu_loras(self) -> int:
        """max_cpu_loras with its default applied."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(16, self.max_loras)

    def torch_device(self) -> torch.device:
        """The device "auto" resolves to (cuda when available, else cpu)."""
        import torch

        from lora_runner.device import resolve_device

        device = resolve_device(self.device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA device is available; use 'cpu' or 'auto'")
        return device

    def torch_dtype(self) -> torch.dtype:
        """The dtype "auto" resolves to: bfloat16 on CUDA, float32 on CPU."""
        from lora_runner.device import resolve_dtype

        return resolve_dtype(self.dtype, self.torch_device())

    @property
    def executor_backend(self) -> str:
        """distributed_executor_backend with its default applied: "uni", "mp" or "ray"."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    def _check_batch_invariant(self) -> None:
        """ValueError where batch_invariant cannot hold. On CUDA the mode runs the fixed-order Triton kernels
        (punica_kernels.invariant_triton's GEMM and RMSNorm, the LoRA shrink unsplit, every token through the
        prefill attention kernel), so Triton must import; NCCL's all-reduce over more than two ranks sums in an
        order set by the message size; quantized layers run GEMMs outside the mode's kernels (CPU and CUDA)."""
        if not self.batch_invariant:
            return
        if not isinstance(self.batch_invariant, bool):
            raise ValueError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.quantization is not None:
            raise ValueError(f"batch_invariant needs an unquantized model, got quantization={self.quantization!r}: "
                             "the FP8 and W4A16 GEMMs have no fixed-order kernel yet")
        if self.torch_device().type != "cuda":
            return
        from punica_kernels import triton_available, triton_import_error

        if not triton_available():
            raise ValueError("batch_invariant on CUDA needs Triton (its fixed-order GEMM, LoRA and attention "
                             f"kernels), which failed to import: {triton_import_error()}; use device='cpu'")
        if self.tensor_parallel_size > 2:
            raise ValueError("batch_invariant on CUDA holds for tensor_parallel_size 1 or 2: NCCL's all-reduce "
                             "over more ranks adds the partial sums in an order set by the message size, got "
                             f"tensor_parallel_size={self.tensor_parallel_size}")

    def check_parallel(self) -> None:
        """ValueError when tensor_parallel_size cannot run on the chosen device (CUDA: one GPU per rank)."""
        import torch

        device, size = self.torch_device(), self.tensor_parallel_size
        if size > 1 and device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices, "
                             f"{torch.cuda.device_count()} are visible")
        if size > 1 and device.type == "cuda" and device.index not in (None, 0):
            raise ValueError(f"at tensor_parallel_size > 1 rank r runs on cuda:r; device={self.device!r} "
                             "cannot be honoured (use CUDA_VISIBLE_DEVICES to choose the GPUs)")


def _check_int(name: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
