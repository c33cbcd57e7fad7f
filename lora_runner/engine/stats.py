"""EngineStats: what the engine's step loop looked like after its latest step, as one frozen snapshot.

The step thread builds a new snapshot after every ``LLMEngine.step()`` and swaps it in as one
reference, so a reader on another thread (the server's ``/metrics``) gets a consistent view without
touching the scheduler or the block manager, which only the step thread may read while it steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from adapters.manager import AdapterStats
from lora_runner.outputs import SpecDecodingStats


@dataclass(frozen=True)
class EngineStats:
    """The engine after its latest step (at construction: before any step).

    running / waiting: requests being prefilled or decoded / queued (loading adapters or no room).
    kv_blocks_used / kv_blocks_total: KV-cache blocks held by requests / in the cache.
    preemptions: running requests preempted (their blocks freed, recomputed later) since start.
    prefix_cache_queries / prefix_cache_hits: prompt tokens of admitted requests looked up in the
    prefix cache / of those, found computed (cumulative, as vLLM's counters; 0 with caching off).
    kv_blocks_cached: blocks holding a cached prefix (held by requests or evictable).
    spec_decode: speculative decoding's cumulative counters (verify steps, draft tokens, accepted ones,
    accepted per draft position; a copy); None when it is off. spec_decode_by_adapter: the same per
    adapter name (a LoRA's, else a soft prompt's; None: the base model), for the adapters whose
    requests verified drafts ({} when off). draft_forwards / draft_computed_tokens: the "draft_model"
    method's draft forward passes and the tokens they computed (cumulative); None / 0 without a draft model.
    running_loras / waiting_loras: the distinct LoRA names of the running / waiting requests, sorted
    (vLLM's lora_requests_info); max_loras: the LoRAs one step may run (the scheduler's).
    steps: step() calls since start. adapters: the adapter manager's cumulative counters, read when
    the snapshot is handed out (``LLMEngine.stats``: loads also finish between steps, and the step
    thread need not take the tiers' locks every step for them); None in the step's own part.
    """

    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    preemptions: int
    steps: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_blocks_cached: int = 0
    adapters: AdapterStats | None = None
    spec_decode: SpecDecodingStats | None = None
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    max_loras: int = 0
    spec_decode_by_adapter: dict[str | None, SpecDecodingStats] = field(default_factory=dict)
    draft_forwards: int | None = None
    draft_computed_tokens: int = 0

    @classmethod
    def collect(cls, scheduler, block_manager, steps: int) -> EngineStats:
        """A snapshot of `scheduler` and `block_manager` (call on the step thread, between steps)."""
        # the draft model's counters (spec_decode.draft_model.DraftModelSpeculator), behind its SpeculationPolicy
        draft = getattr(getattr(scheduler, "speculator", None), "proposer", None)
        return cls(running=len(scheduler.running), waiting=len(scheduler.waiting),
                   kv_blocks_used=block_manager.num_used_blocks, kv_blocks_total=block_manager.num_blocks,
                   preemptions=scheduler.num_preemptions, steps=steps,
                   prefix_cache_queries=scheduler.prefix_query_tokens, prefix_cache_hits=scheduler.prefix_hit_tokens,
                   kv_blocks_cached=block_manager.num_cached_blocks,
                   running_loras=_lora_names(scheduler.running), waiting_loras=_lora_names(scheduler.waiting),
                   max_loras=scheduler.max_loras,
                   spec_decode=None if getattr(scheduler, "speculator", None) is None else _copy(scheduler.spec),
                   spec_decode_by_adapter={name: _copy(stats)
                                           for name, stats in getattr(scheduler, "spec_by_adapter", {}).items()},
                   draft_forwards=getattr(draft, "num_forwards", None),
                   draft_computed_tokens=getattr(draft, "num_computed_tokens", 0))


def _copy(stats: SpecDecodingStats) -> SpecDecodingStats:
    """A copy the step thread no longer changes."""
    return replace(stats, accepted_per_position=list(stats.accepted_per_position))


def _lora_names(requests) -> tuple[str, ...]:
    """The distinct LoRA names of `requests`, sorted (one set over the queue: no per-request work beyond it)."""
    return tuple(sorted({r.lora_request.name for r in requests if r.lora_request is not None}))
