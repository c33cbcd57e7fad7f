"""Decode graphs on a real model runner: replay equals eager on the same padded batch (bit for bit:
same kernels) and the plain eager step (tolerance), for 1..32 requests with up to max_loras adapters
of mixed ranks plus no-adapter requests, although capture saw one dummy adapter; adapters loaded
after capture are served. "cpu" replays with RerunGraph (the same plumbing, re-running the captured
function); "cuda" captures real CUDA graphs (marked gpu, skipped without CUDA)."""

import random

import pytest
import torch

from adapters import LoRARequest
from adapters.manager import AdapterManager
from lora_runner.model import load_model
from lora_runner.model.forward_context import ForwardContext
from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.batch_builder import SeqChunk
from lora_runner.worker.cuda_graphs import DecodeGraphKey, DecodeGraphPlan, DecodeGraphs, RerunGraph, resident_dummy_loras
from lora_runner.worker.model_runner import ModelRunner

MAX_LORAS, MAX_RANK, MAX_NUM_SEQS, BLOCK_SIZE, WIDTH = 4, 16, 32, 4, 8  # WIDTH: blocks per sequence
FIRST_ADAPTERS = ["r4", "r8-rslora", "r16-patterns", "r8-qv"]  # ranks 4, 8, 16 (down 4), 8
BACKENDS = [("cpu", torch.float32), pytest.param(("cuda", torch.float32), marks=pytest.mark.gpu),
            pytest.param(("cuda", torch.bfloat16), marks=pytest.mark.gpu)]
# replay vs the plain (unpadded) eager step; bf16: the bit-for-bit check against the same kernels only
TOLERANCE = {("cpu", torch.float32): 2e-5, ("cuda", torch.float32): 1e-4, ("cuda", torch.bfloat16): None}


@torch.inference_mode()
def replay_step(graphs, batch):
    """The runner's graphed path on a step just built: key_for -> upload padded -> replay; hidden
    [T, hidden] of its real tokens, or None when the step runs eagerly."""
    key = graphs.key_for(batch)
    if key is None:
        return None
    return graphs.replay(key, graphs.builder.upload(batch, padded_seqs=key.num_seqs))[:batch.num_tokens]


class Rig:
    """A model runner, its adapter manager, and decode graphs captured with one dummy adapter."""

    def __init__(self, checkpoint, device, dtype):
        path, _, self.adapter_dirs = checkpoint
        model, config, _ = load_model(path, dtype=dtype, device=device)
        self.manager = AdapterManager(config.spec(), max_loras=MAX_LORAS, max_lora_rank=MAX_RANK, max_cpu_loras=8,
                                      device=device, dtype=dtype)
        self.runner = ModelRunner(model, config, self.manager.lora_slots, num_kv_blocks=1 + MAX_NUM_SEQS * WIDTH,
                                  block_size=BLOCK_SIZE, max_num_tokens=128, max_num_seqs=MAX_NUM_SEQS,
                                  max_blocks_per_seq=WIDTH, max_loras=MAX_LORAS, max_lora_rank=MAX_RANK,
                                  dtype=dtype, device=torch.device(device))
        plan = DecodeGraphPlan(MAX_NUM_SEQS)
        runner = self.runner
        self.graphs = DecodeGraphs(runner.model, runner.forward_contexts, runner.batch_builder, plan,
                                   make_graph=RerunGraph if device == "cpu" else None)
        with resident_dummy_loras(self.manager.loras, 1, MAX_RANK) as slots:
            self.graphs.capture(slots[0], progress=False)
        assert len(self.graphs) == len(plan.keys()) == 7 * 3  # sizes x (without LoRA, plain LoRA, all LoRA work)
        assert int(self.manager.lora_slots.slot_ranks.max()) == 0 and self.manager.loras.list() == []

    def activate(self, names):
        refs = [self.manager.loras.add(LoRARequest(name, self.adapter_dirs[name][0])) for name in names]
        return dict(zip(names, self.manager.loras.activate(refs)))

    def decode_step(self, rng, num_requests, slots):
        """Prefill `num_requests` random prompts (eagerly) on slots drawn from `slots`, then return
        their decode chunks (one new token each: the greedy token the prefill sampled)."""
        kv = self.runner.kv_cache
        kv.fill_(float("nan"))  # blocks a sequence does not own (block 0 included) hold NaN
        free = list(range(1, 1 + MAX_NUM_SEQS * WIDTH))
        rng.shuffle(free)
        prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(2, 6 * BLOCK_SIZE))]
                   for _ in range(num_requests)]
        chunks = [SeqChunk(token_ids=p, start=0, num_new_tokens=len(p), block_table=[free.pop() for _ in range(WIDTH)],
                           lora_slot=rng.choice(slots)) for p in prompts]
        greedy = SamplingParams(temperature=0.0)
        for i in range(0, num_requests, 4):  # <= 4 * 24 tokens per step
            part = chunks[i:i + 4]
            tokens = self.runner.execute_chunks(part, [greedy] * len(part), [None] * len(part)).token_ids
            for chunk, token in zip(part, tokens):
                chunk.token_ids = chunk.token_ids + [token]
                chunk.start, chunk.num_new_tokens = chunk.num_new_tokens, 1
        return chunks

    def check_step(self, chunks, tol):
        """Replay vs eager on the same padded inputs (bitwise) and vs the plain eager step."""
        runner, graphs = self.runner, self.graphs
        for captured in graphs._graphs.values():
            captured.hidden.fill_(float("nan"))
        batch = runner.batch_builder.build(chunks)
        replayed = replay_step(graphs, batch)
        assert replayed is not None and replayed.shape[0] == len(chunks)
        replayed = replayed.clone()  # [T, hidden]
        assert torch.isfinite(replayed).all()
        same_kernels = graphs.run_eager(batch)
        assert torch.equal(replayed, same_kernels), (replayed - same_kernels).abs().max()
        batch = runner.batch_builder.build(chunks)  # again: on a device each upload moves the views
        ctx = runner.forward_contexts.for_step(batch)
        plain = runner.model(batch.input_ids, batch.positions, ctx)  # [T, hidden], unpadded, eager
        if tol is not None:
            torch.testing.assert_close(replayed, plain, rtol=tol, atol=tol)
        # the adapters matter: without them the adapter rows move by far more than the tolerance
        base = runner.model(batch.input_ids, batch.positions, ForwardContext(ctx.attn, ctx.kv_cache))
        with_lora = torch.tensor([c.lora_slot >= 0 for c in chunks], device=base.device)
        if tol is not None:
            torch.testing.assert_close(replayed[~with_lora], base[~with_lora], rtol=tol, atol=tol)
        if with_lora.any():
            assert (replayed[with_lora] - base[with_lora]).abs().amax(-1).min() > 1e-3


@pytest.fixture(scope="module", params=BACKENDS, ids=["cpu-rerun", "cuda-fp32", "cuda-bf16"])
def rig(request, engine_checkpoint):
    device, dtype = request.param
    with torch.inference_mode():
        return Rig(engine_checkpoint, device, dtype), TOLERANCE[device, dtype]


@pytest.mark.parametrize("num_requests", [1, 3, 8, 17, 32])
@torch.inference_mode()
def test_replay_matches_eager_with_mixed_adapters(rig, num_requests):
    rig, tol = rig
    slot_of = rig.activate(FIRST_ADAPTERS)
    assert sorted(slot_of.values()) == list(range(MAX_LORAS))
    rng = random.Random(num_requests)
    slots = [-1, *slot_of.values()]
    chunks = rig.decode_step(rng, num_requests, slots)
    if num_requests >= 8:  # every adapter and the base model in the batch
        for chunk, slot in zip(chunks, slots):
            chunk.lora_slot = slot
    rig.check_step(chunks, tol)


@torch.inference_mode()
def test_adapter_loaded_after_capture_is_served(rig):
    """Replace resident adapters with new ones (same slots, other ranks and targets) and replay."""
    rig, tol = rig
    first = rig.activate(FIRST_ADAPTERS)
    rng = random.Random(7)
    rig.check_step(rig.decode_step(rng, 9, [-1, *first.values()]), tol)
    rig.manager.loras.remove("r16-patterns")
    rig.manager.loras.remove("r4")
    second = rig.activate(["r16-mlp", "r8-qv"])  # r16-mlp takes a freed slot
    assert second["r16-mlp"] in (first["r16-patterns"], first["r4"])
    chunks = rig.decode_step(rng, 9, [-1, second["r16-mlp"]])
    chunks[0].lora_slot = second["r16-mlp"]
    rig.check_step(chunks, tol)
    for name in ("r8-rslora", "r8-qv", "r16-mlp"):
        rig.manager.loras.remove(name)


@torch.inference_mode()
def test_eager_fallbacks(rig):
    """Prefill, mixed and oversized steps get no graph; decodes of every size do."""
    rig, _ = rig
    graphs, builder = rig.graphs, rig.runner.batch_builder
    rng = random.Random(3)
    chunks = rig.decode_step(rng, 5, [-1])
    assert replay_step(graphs, builder.build(chunks)) is not None
    prefill = SeqChunk(token_ids=[5, 6, 7], start=0, num_new_tokens=3, block_table=[1])
    assert replay_step(graphs, builder.build([prefill])) is None
    assert replay_step(graphs, builder.build(chunks + [prefill])) is None
    small = DecodeGraphs(rig.runner.model, rig.runner.forward_contexts, builder, DecodeGraphPlan(4),
                         make_graph=RerunGraph)
    assert len(small) == 0 and replay_step(small, builder.build(chunks)) is None  # nothing captured


@torch.inference_mode()
def test_replay_step_does_not_sync(rig):
    """Padding, the LoRA table and replay queue work without waiting for the device (CUDA only)."""
    rig, _ = rig
    if rig.runner.device.type != "cuda":
        pytest.skip("host syncs only exist with a device")
    slot_of = rig.activate(FIRST_ADAPTERS[:2])
    batch = rig.runner.batch_builder.build(rig.decode_step(random.Random(11), 6, [-1, *slot_of.values()]))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        assert replay_step(rig.graphs, batch) is not None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@torch.inference_mode()
def test_base_only_step_replays_the_graph_without_lora(rig, monkeypatch):
    """A step without adapters replays a (size, has_lora=False) graph: equal to the base model, and on
    CPU (where replay reruns the captured function) no LoRA kernel is called; a step with one adapter
    replays the LoRA graph of the same size."""
    import punica_kernels

    rig, tol = rig
    slot_of = rig.activate(FIRST_ADAPTERS[:1])
    chunks = rig.decode_step(random.Random(13), 5, [-1])
    calls = []
    add_lora = punica_kernels.add_lora
    monkeypatch.setattr(punica_kernels, "add_lora", lambda *args, **kwargs: calls.append(1) or add_lora(*args, **kwargs))
    batch = rig.runner.batch_builder.build(chunks)
    assert rig.graphs.plan.key_for(batch) == DecodeGraphKey(8, False)
    rig.check_step(chunks, tol)
    assert not calls
    chunks[2].lora_slot = slot_of[FIRST_ADAPTERS[0]]
    assert rig.graphs.plan.key_for(rig.runner.batch_builder.build(chunks)) == DecodeGraphKey(8, True)
    rig.check_step(chunks, tol)
    assert calls or rig.runner.device.type == "cuda"  # a CUDA replay runs no Python
    rig.manager.loras.remove(FIRST_ADAPTERS[0])
