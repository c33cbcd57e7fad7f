"""Start-up memory profiling: how much device memory the KV cache may take.

With ``max_loras`` dummy adapters of rank ``max_lora_rank`` resident (so the LoRA path runs for
every token), a runner with a small KV cache executes the largest steps the scheduler can produce;
the peak torch allocation above the resident weights is the activation memory to keep free. The KV
cache then gets what is left of ``gpu_memory_utilization`` of the device, minus memory used outside
torch's allocator (CUDA context, other processes), minus (with CUDA graphs) one more decode-step
peak for the graphs' shared pool.

Profiled steps: one prefill chunk of min(max_num_batched_tokens, max_model_len) tokens ending at
max_model_len (longest attention context), max_num_seqs prefills sharing the token budget, and
max_num_seqs decodes at full context (also what the largest decode graph holds), and with speculative
decoding's verify graphs (k + 1 tokens per sequence) the largest verify step, min(max_num_seqs,
max_num_batched_tokens // (k + 1)) sequences of k + 1 tokens at full context; the graphs' pool is
the larger of the two. The torch paged
attention pads every sequence of a mixed step to its longest chunk, so a mixed step of one long
chunk and many decodes may need more than this; lower max_num_batched_tokens if that happens.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.batch_builder import SeqChunk
from lora_runner.worker.cuda_graphs import resident_dummy_loras

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory measured at start-up, in bytes."""

    total: int  # device memory
    non_torch: int  # in use outside torch's caching allocator (CUDA context, libraries, other processes)
    resident: int  # allocated by torch outside any step: weights, adapter slots, buffers
    activation: int  # peak allocation of the largest profiled step above `resident`
    decode_activation: int  # the same for a max_num_seqs decode step at full context (or the verify step's)

    def kv_cache_budget(self, gpu_memory_utilization: float, cuda_graphs: bool) -> int:
        """Bytes the KV cache may take: utilization * total - non_torch - resident - activation, minus
        decode_activation when CUDA graphs will be captured (their pool). Raises ValueError if <= 0."""
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        graphs = self.decode_activation if cuda_graphs else 0
        budget = int(gpu_memory_utilization * self.total) - self.non_torch - self.resident - self.activation - graphs
        if budget <= 0:
            raise ValueError(
                f"no device memory left for the KV cache: {gpu_memory_utilization:.2f} of {self.total / 2**30:.1f} "
                f"GiB minus {self.resident / 2**30:.2f} GiB weights/slots, {self.activation / 2**30:.2f} GiB "
                f"activations, {graphs / 2**30:.2f} GiB for CUDA graphs and {self.non_torch / 2**30:.2f} GiB "
                "used outside torch; raise gpu_memory_utilization, lower max_num_batched_tokens / "
                "max_num_seqs / max_loras, or set enforce_eager=True")
        return budget


def profile_steps(*, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                  lora_slots: Sequence[int], verify_tokens_per_seq: int = 0) -> dict[str, list[SeqChunk]]:
    """The steps to profile, by name (see the module docstring). Tokens cycle over `lora_slots`; all
    sequences share KV blocks 0..ceil(max_model_len / block_size)-1 (the contents do not matter).
    verify_tokens_per_seq: k + 1 adds the "verify" step (0: no verify graphs)."""
    if not lora_slots:
        raise ValueError("profile with at least one resident adapter slot")
    blocks = list(range(-(-max_model_len // block_size)))
    token_ids = [0] * max_model_len

    def chunk(i: int, start: int, num_new_tokens: int) -> SeqChunk:
        end = start + num_new_tokens
        return SeqChunk(token_ids=token_ids, start=start, num_new_tokens=num_new_tokens,
                        block_table=blocks[:-(-end // block_size)], lora_slot=lora_slots[i % len(lora_slots)])

    long = min(max_num_batched_tokens, max_model_len)
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    per_seq, extra = divmod(min(max_num_batched_tokens, num_seqs * max_model_len), num_seqs)
    steps = {
        "long prefill": [chunk(0, max_model_len - long, long)],
        "many prefills": [chunk(i, 0, per_seq + (i < extra)) for i in range(num_seqs)],
        "decode": [chunk(i, max_model_len - 1, 1) for i in range(num_seqs)],
    }
    q = min(verify_tokens_per_seq, max_model_len)
    verify_seqs = min(max_num_seqs, max_num_batched_tokens // q) if q > 1 else 0
    if verify_seqs:
        steps["verify"] = [chunk(i, max_model_len - q, q) for i in range(verify_seqs)]
    return steps


def profile_memory(runner, steps: dict[str, list[SeqChunk]]) -> MemoryProfile:
    """Run `steps` on `runner` (a ModelRunner with dummy adapters resident in the steps' slots) and
    measure. On CPU the steps run (a smoke test of the path) and every figure is 0."""
    device = runner.device
    on_cuda = device.type == "cuda"
    peaks = {}
    if on_cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    resident = torch.cuda.memory_allocated(device) if on_cuda else 0
    for name, chunks in steps.items():
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        greedy = SamplingParams(temperature=0.0)
        runner.execute_chunks(chunks, [greedy] * len(chunks), [None] * len(chunks))
        if on_cuda:
            torch.cuda.synchronize(device)
            peaks[name] = torch.cuda.max_memory_allocated(device) - resident
        else:
            peaks[name] = 0
        logger.info("memory profile: %s step (%d sequences, %d tokens) peaks at %.0f MiB above resident",
                    name, len(chunks), sum(c.num_new_tokens for c in chunks), peaks[name] / 2**20)
    if not on_cuda:
        return MemoryProfile(0, 0, 0, 0, 0)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    return MemoryProfile(total=total, non_torch=non_torch, resident=resident,
                         activation=max(peaks.values()),
                         decode_activation=max(peaks.get("decode", 0), peaks.get("verify", 0)))


def profile_kv_cache_budget(make_runner: Callable[[int], object], lora_tier, *, max_loras: int, max_lora_rank: int,
                            max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int, block_size: int,
                            gpu_memory_utilization: float, cuda_graphs: bool, verify_tokens_per_seq: int = 0) -> int:
    """Bytes the KV cache may take on this device (see the module docstring).

    make_runner(num_kv_blocks) builds a ModelRunner sized like the engine's; a throwaway one with a
    single sequence's worth of blocks runs the profile while ``max_loras`` dummy LoRAs of rank
    ``max_lora_rank`` are resident in ``lora_tier`` (removed afterwards). verify_tokens_per_seq: k + 1
    when verify graphs will be captured (profile_steps). Raises ValueError when nothing is left for the
    KV cache.
    """
    runner = make_runner(-(-max_model_len // block_size))
    with resident_dummy_loras(lora_tier, max_loras, max_lora_rank, prefix="__memory_profile__") as slots:
        steps = profile_steps(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              max_model_len=max_model_len, block_size=block_size, lora_slots=slots,
                              verify_tokens_per_seq=verify_tokens_per_seq if cuda_graphs else 0)
        profile = profile_memory(runner, steps)
    del runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    budget = profile.kv_cache_budget(gpu_memory_utilization, cuda_graphs)
    logger.info("memory profile: %.1f GiB device, %.2f GiB weights/slots/buffers, %.2f GiB peak activations, "
                "%.2f GiB outside torch%s -> KV cache budget %.2f GiB (gpu_memory_utilization=%.2f)",
                profile.total / 2**30, profile.resident / 2**30, profile.activation / 2**30,
                profile.non_torch / 2**30,
                f", {profile.decode_activation / 2**30:.2f} GiB for CUDA graphs" if cuda_graphs else "",
                budget / 2**30, gpu_memory_utilization)
    return budget
