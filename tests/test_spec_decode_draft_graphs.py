"""The draft model's graphs with its per-request adapters, and its adapter slots in the memory budget.

Graphs (lora_runner.worker.draft_runner.DraftModelRunner.capture_graphs): with draft adapters the draft's
decode and verify graphs are captured with its LoRA context, as the target's are, so a draft forward whose
rows mix draft adapters (LoRAs of two ranks, DoRA) and base rows replays a graph. With the draft = the target
and each request's draft adapter = its own adapter, every draft is accepted, and the tokens are those without
speculation; the proposals equal an engine whose draft runs eagerly. Emulated on CPU (RerunGraph replays
read the persistent buffers, so a LoRA table left stale in them shows up as other drafts); the gpu-marked
twin captures real CUDA graphs at start-up.

Memory (lora_runner.executor.draft_budget): the draft adapters' slots are allocated after the KV budget is
drawn; their bytes, counted from adapters.slot_memory, are the bytes of the slot tensors the engine really
allocates, are taken off the profiled budget, and are in the draft's one INFO line.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from adapters import LoRARequest
from engine_support import run_to_completion
from factories import save_lora
from lora_runner import EngineConfig, LLMEngine, SamplingParams
from lora_runner.executor.draft_budget import draft_memory, limits_with_draft
from lora_runner.model import ModelConfig
from lora_runner.worker.cuda_graphs import DecodeGraphKey, RerunGraph
from lora_runner.worker.draft_runner import LoadedDraft, load_draft
from lora_runner.worker.kv_cache import kv_block_bytes
from test_spec_decode_draft_lora import K, assert_every_draft_accepted, model, prompts, spec, tokens  # noqa: F401

NAMES = (None, "r4", "r8-rslora", "dora")  # base rows, LoRAs of two ranks, DoRA: one request each in turn


@pytest.fixture(scope="module")
def dirs(model, engine_checkpoint, tmp_path_factory):  # noqa: F811 (the imported fixture)
    """{name: adapter dir}: the conftest's LoRAs and a DoRA one."""
    _, hf, _ = engine_checkpoint
    dora = tmp_path_factory.mktemp("draft-graphs") / "dora"
    save_lora(hf, dora, seed=6, r=8, use_dora=True)
    return {**model[1], "dora": str(dora)}


def mixed(dirs, n=12, seed=5):
    """n greedy requests cycling NAMES, each adapter its own draft adapter."""
    return [(prompt, None if NAMES[i % 4] is None else
             LoRARequest(NAMES[i % 4], dirs[NAMES[i % 4]], draft_lora_path=dirs[NAMES[i % 4]]))
            for i, prompt in enumerate(prompts(n, seed))]


def run(path, speculative_config, requests, device="cpu", before=None, **engine):
    """({index: RequestOutput}, engine) of `requests` [(prompt, LoRARequest | None)], their adapters loaded
    first, two joining per step; before(engine) runs first."""
    engine = LLMEngine(path, device=device, max_num_seqs=4, max_model_len=64, block_size=4, max_loras=3,
                       max_lora_rank=16, max_num_batched_tokens=16, speculative_config=speculative_config,
                       cpu_threads=1, **engine)
    if before is not None:
        before(engine)
    for lora in dict.fromkeys(lora for _, lora in requests if lora is not None):
        engine.add_lora(lora)  # its draft adapter too: no request waits on a load, so the steps are the same
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    done = run_to_completion(engine, [(f"r{i}", prompt, params, lora) for i, (prompt, lora) in enumerate(requests)],
                             per_step=2)
    done = {int(request_id[1:]): output for request_id, output in done.items()}
    engine.close()
    return done, engine


@dataclass(frozen=True)
class Forward:
    """One draft forward: its rows' LoRA slots, its longest row, the graph it replayed (None: eager)."""

    slots: tuple[int, ...]
    max_new_tokens: int
    key: DecodeGraphKey | None


def record_forwards(forwards: list[Forward]):
    """before(engine) for run: capture the draft's graphs (emulated) and log every draft forward."""
    def before(engine):
        proposer = engine.scheduler.speculator.proposer
        runner = proposer.forward
        runner.capture_graphs(K, make_graph=RerunGraph)
        replayed = []
        replay = runner.graphs.replay
        runner.graphs.replay = lambda key, padded: replayed.append(key) or replay(key, padded)

        def forward(chunks):
            replayed.clear()
            try:
                return runner(chunks)
            finally:  # a forward that raised (a replay refused) is logged too, as eager
                forwards.append(Forward(tuple(c.lora_slot for c in chunks), max(c.num_new_tokens for c in chunks),
                                        replayed[0] if replayed else None))
        forward.runner = runner
        proposer.forward = forward
    return before


def spec_counts(done):
    return {i: (out.spec_decode.num_draft_tokens, out.spec_decode.num_accepted_tokens) for i, out in done.items()}


def test_every_draft_forward_with_draft_adapters_replays_a_graph(model, dirs):  # noqa: F811
    """Every draft forward of at most k + 1 tokens per row replays a graph, draft-adapter rows of LoRA and
    DoRA beside base rows included (none falls back to eager); every draft is accepted, the tokens are those
    without speculation, and the proposals those of the eager draft."""
    path = model[0]
    requests = mixed(dirs)
    plain, _ = run(path, None, requests)
    eager, _ = run(path, spec(path), requests)
    forwards: list[Forward] = []
    graphed, engine = run(path, spec(path), requests, before=record_forwards(forwards))
    assert tokens(graphed) == tokens(eager) == tokens(plain)
    assert_every_draft_accepted(graphed, "draft graphs with draft adapters")
    assert spec_counts(graphed) == spec_counts(eager)
    runner = engine.scheduler.speculator.proposer.forward.runner
    fits = [f for f in forwards if f.max_new_tokens <= K + 1]
    assert [f for f in fits if f.key is None] == [] and runner.num_eager_fallbacks == 0
    assert runner.num_eager_forwards == sum(f.key is None for f in forwards) > 0  # the prompts' catch-ups
    assert any(-1 in f.slots and len(set(f.slots) - {-1}) >= 2 for f in fits), "no forward mixed base rows and adapters"
    kinds = {(f.key.has_lora, f.key.lora_features.dora, f.key.tokens_per_seq) for f in fits}
    assert {(True, False, 1), (True, True, 1), (True, False, K + 1), (True, True, K + 1)} <= kinds, kinds


@pytest.mark.gpu
def test_cuda_draft_graphs_with_draft_adapters_at_start_up(model, dirs):  # noqa: F811
    """On CUDA the engine captures the draft's graphs with its LoRA at start-up (the target's pool, the
    draft adapters' slots off the profiled budget); every draft forward of a graph's shape replays, the
    tokens equal an enforce_eager engine's without speculation (fp32) and the drafts are accepted."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path = model[0]
    requests = mixed(dirs)
    plain, _ = run(path, None, requests, device="cuda", dtype="float32", enforce_eager=True,
                   kv_cache_memory_bytes=64 << 20)
    done, engine = run(path, spec(path), requests, device="cuda", dtype="float32", gpu_memory_utilization=0.5)
    runner = engine.scheduler.speculator.proposer.forward
    assert runner.graphs is not None and runner.graphs.pool is engine.runner.decode_graphs.pool
    assert any(key.has_lora for key in runner.graphs.plan.keys())
    assert tokens(done) == tokens(plain)
    assert runner.num_eager_fallbacks == 0 and runner.graphs.num_replays > runner.num_eager_forwards
    drafted = sum(out.spec_decode.num_draft_tokens for out in done.values())
    accepted = sum(out.spec_decode.num_accepted_tokens for out in done.values())
    assert drafted > 0 and accepted >= 0.95 * drafted  # draft = target: all but a rounding tie (a stale table: ~10%)


# ------------------------------------------------------------------ the draft adapters' slots in the budget
def slot_tensor_bytes(slots) -> int:
    """Bytes of every tensor the slot objects hold (each storage once, found through their attributes), less
    the [num_slots] int32 rank vectors (bookkeeping: 4 bytes a slot, which adapters.slot_memory leaves out)."""
    storages = {}

    def walk(value, depth):
        if isinstance(value, torch.Tensor):
            if not (value.dtype == torch.int32 and value.dim() == 1):
                storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif depth < 4 and type(value).__module__.startswith("adapters."):
            for item in vars(value).values():
                walk(item, depth + 1)

    for member in slots:
        walk(member, 0)
    return sum(storages.values())


def test_draft_adapter_slot_bytes_are_the_allocated_slots(model, caplog):  # noqa: F811
    """The bytes the budget takes off for the draft adapters are those of the slot tensors the engine
    allocates (max_draft_loras of them, not max_loras), and the draft's one INFO line says them."""
    path = model[0]
    with caplog.at_level(logging.INFO, "lora_runner.executor.draft_budget"):
        engine = LLMEngine(path, device="cpu", max_model_len=64, block_size=4, max_loras=2, max_lora_rank=16,
                           cpu_threads=1, speculative_config=spec(path, max_draft_loras=3))
    draft = engine.scheduler.speculator.proposer
    manager = draft.adapters.manager
    allocated = slot_tensor_bytes([manager.lora_slots, manager.vocab_slots, manager.prompt_slots])
    memory = draft_memory(LoadedDraft(draft.forward.model, ModelConfig.from_dir(path), Path(path)), engine.config)
    assert memory.num_lora_slots == 3 == manager.lora_slots.num_slots
    assert memory.lora_slot_bytes == allocated > 0
    [line] = [r.getMessage() for r in caplog.records if r.name == "lora_runner.executor.draft_budget"]
    assert f"its 3 adapter slots {allocated} bytes" in line, line
    engine.close()


def test_draft_adapter_slots_come_off_the_profiled_budget(model):  # noqa: F811
    """The memory profile ran before the draft adapters' slots were allocated: its budget less their bytes
    holds the KV caches (as a budget that much smaller without them), and one they do not fit is refused."""
    path = model[0]
    cfg = EngineConfig(model=path, device="cpu", max_model_len=64, block_size=4, max_num_seqs=4,
                       max_num_batched_tokens=16, speculative_config=spec(path))
    loaded = load_draft(cfg.speculative(), dtype=torch.float32, device=torch.device("cpu"))
    memory = draft_memory(loaded, cfg)
    per_token = kv_block_bytes(ModelConfig.from_dir(path), 1, torch.float32)
    budget = 200_000

    def blocks(draft, profiled):
        return limits_with_draft(cfg, 512, per_token, draft, free_device_bytes=10**9,
                                 device_kv_budget_bytes=profiled).num_kv_blocks
    slots, uncounted = memory.lora_slot_bytes, dataclasses.replace(memory, lora_slot_bytes=0)
    assert slots > 0
    assert blocks(memory, budget + slots) == blocks(uncounted, budget) < blocks(uncounted, budget + slots)
    with pytest.raises(ValueError, match="adapter slots.*lower max_draft_loras"):
        blocks(memory, memory.lora_slot_bytes)
