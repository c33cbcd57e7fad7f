"""Speculative decoding's verify step in decode graphs (lora_runner.worker.cuda_graphs, verify keys):
which steps replay a verify graph of k + 1 tokens per sequence, the padding written into the persistent
buffers, the graphs' forward free of host syncs, and an engine whose verify steps replay emulated graphs
(RerunGraph) giving the eager engine's tokens and logprobs across a mixed batch of adapters. The gpu-marked
test captures real CUDA graphs at start-up and compares with an enforce_eager engine."""

from __future__ import annotations

import random

import pytest
import torch

from adapters import LoRARequest
from engine_support import run_to_completion
from lora_runner import LLMEngine, SamplingParams
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.cuda_graphs import DecodeGraphKey, DecodeGraphPlan, RerunGraph
from lora_runner.worker.memory_profile import profile_steps
from test_gpu_readiness import host_sync_ops, stub_lora_kernels

K = 3  # drafts per sequence: verify graphs of K + 1 tokens per sequence
ENGINE = dict(max_num_seqs=8, max_model_len=64, max_loras=2, max_lora_rank=16, max_cpu_loras=4, block_size=4,
              max_num_batched_tokens=32, dtype="float32", max_logprobs=2,
              speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 3, "min_acceptance_rate": 0})
BUFFERS = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
           "block_tables", "sample_indices")


def verify_chunks(rng: random.Random, num_seqs: int, max_len: int, block_size: int = 4, width: int = 8):
    """num_seqs chunks of 1..max_len new tokens each (a decode and its drafts), on distinct random blocks."""
    free = list(range(1, 1 + num_seqs * width))
    rng.shuffle(free)
    chunks = []
    for _ in range(num_seqs):
        new = rng.randint(1, max_len)
        total = rng.randint(new, width * block_size)
        chunks.append(SeqChunk(token_ids=[rng.randrange(1000) for _ in range(total)], start=total - new,
                               num_new_tokens=new, block_table=[free.pop() for _ in range(-(-total // block_size))],
                               lora_slot=rng.choice((-1, 0, 1))))
    return chunks


def test_plan_verify_keys_and_decision():
    plan = DecodeGraphPlan(32, verify_tokens_per_seq=K + 1, max_num_tokens=64)
    assert plan.verify_sizes == [1, 2, 4, 8, 16]  # 16 * 4 tokens fill the token buffers
    keys = plan.keys()
    assert len(keys) == 3 * (len(plan.sizes) + len(plan.verify_sizes))
    assert [key.num_tokens for key in keys] == sorted((key.num_tokens for key in keys), reverse=True)
    assert keys[0].num_tokens == 64
    builder = BatchBuilder(max_num_tokens=64, max_num_seqs=32, max_blocks_per_seq=8, block_size=4, device="cpu")
    rng = random.Random(0)
    for num_seqs in (1, 2, 3, 5, 9, 16):
        chunks = verify_chunks(rng, num_seqs, K + 1)
        chunks[0].start, chunks[0].num_new_tokens = chunks[0].start - (K + 1 - chunks[0].num_new_tokens), K + 1
        key = plan.key_for(builder.build(chunks))
        assert key.tokens_per_seq == K + 1 and key.num_seqs == min(s for s in plan.verify_sizes if s >= num_seqs)
        assert key.has_lora == any(c.lora_slot >= 0 for c in chunks)
    decode = [SeqChunk(token_ids=[1, 2, 3], start=2, num_new_tokens=1, block_table=[1]) for _ in range(3)]
    assert plan.key_for(builder.build(decode)) == DecodeGraphKey(4, False)  # no drafts: the one-token graph
    # a short prefill chunk fits a verify graph too (its tokens are found at run time); a longer one does not
    prefill = SeqChunk(token_ids=list(range(10)), start=0, num_new_tokens=K + 1, block_table=[1, 2, 3])
    assert plan.key_for(builder.build(decode + [prefill])).tokens_per_seq == K + 1
    prefill.num_new_tokens = K + 2
    assert plan.key_for(builder.build(decode + [prefill])) is None
    assert plan.key_for(builder.build(verify_chunks(rng, 17, 2))) is None  # more rows than 64 // 4
    placeholder = SeqChunk(token_ids=list(range(10)), start=2, num_new_tokens=2, block_table=[1, 2, 3],
                           prompt_adapter_slot=0, num_virtual_tokens=4)
    assert plan.key_for(builder.build(decode + [placeholder])) is None
    assert DecodeGraphPlan(32).verify_sizes == [] and DecodeGraphPlan(32).key_for(builder.build([prefill])) is None
    with pytest.raises(ValueError, match="max_num_tokens"):
        DecodeGraphPlan(32, verify_tokens_per_seq=K + 1)


@pytest.mark.parametrize("seed", range(3))
def test_verify_padding_keeps_real_rows_and_writes_padding(seed):
    rng = random.Random(seed)
    plan = DecodeGraphPlan(32, verify_tokens_per_seq=K + 1, max_num_tokens=64)
    builder = BatchBuilder(max_num_tokens=64, max_num_seqs=32, max_blocks_per_seq=8, block_size=4, device="cpu")
    for _ in range(3):  # reuse: leftovers of a bigger step must be overwritten
        for name in BUFFERS:
            getattr(builder, name).cpu.fill_(-12345)
        chunks = verify_chunks(rng, rng.randint(1, 16), K + 1)
        n, t = len(chunks), sum(c.num_new_tokens for c in chunks)
        batch = builder.build(chunks)
        real = {name: getattr(batch, name).clone() for name in BUFFERS}
        key = plan.key_for(batch)
        padded = builder.upload(batch, padded_seqs=key.num_seqs, tokens_per_seq=key.tokens_per_seq)
        p = key.num_seqs
        assert padded.num_seqs == p and padded.num_tokens == p * (K + 1) == key.num_tokens
        assert padded.max_query_len == K + 1 and padded.max_seq_len == 8 * 4
        assert torch.equal(padded.sample_indices, real["sample_indices"])
        for name in ("input_ids", "positions", "slot_mapping", "token_lora_slots"):
            assert torch.equal(getattr(padded, name)[:t], real[name]), name
        for name in ("seq_lens", "block_tables"):
            assert torch.equal(getattr(padded, name)[:n], real[name]), name
        assert torch.equal(padded.query_start_loc[:n + 1], real["query_start_loc"])
        assert (padded.query_start_loc[n + 1:] == t).all()  # padding sequences have no token
        assert (padded.input_ids[t:] == 0).all() and (padded.positions[t:] == 0).all()
        assert (padded.slot_mapping[t:] == -1).all() and (padded.token_lora_slots[t:] == -1).all()
        assert (padded.seq_lens[n:] == 1).all() and (padded.block_tables[n:] == 0).all()
    with pytest.raises(ValueError, match="tokens per sequence"):
        builder.upload(builder.build([SeqChunk(token_ids=list(range(9)), start=3, num_new_tokens=K + 3,
                                               block_table=[1, 2, 3])]), padded_seqs=2, tokens_per_seq=K + 1)


def graphed_spec_engine(path: str) -> LLMEngine:
    engine = LLMEngine(path, device="cpu", **ENGINE)
    engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False,
                                        num_speculative_tokens=K)
    return engine


@torch.inference_mode()
def test_verify_graph_forward_has_no_host_sync(engine_checkpoint, monkeypatch):
    """The verify graphs' captured forward reads no device data on the host (the LoRA and embedding
    kernels are Triton on CUDA, their no-sync tests gpu-marked; stubbed here as in test_gpu_readiness)."""
    path, _, adapters = engine_checkpoint
    engine = graphed_spec_engine(path)
    calls = stub_lora_kernels(monkeypatch)
    engine.adapters.manager.loras.activate([engine.add_lora(LoRARequest("r4", adapters["r4"][0]))])
    graphs = engine.runner.decode_graphs
    verify = [key for key in graphs._graphs if key.tokens_per_seq == K + 1]
    assert verify and {key.num_seqs for key in verify} == set(graphs.plan.verify_sizes)
    for key in verify:
        captured = graphs._graphs[key]
        assert captured.batch.num_tokens == key.num_tokens and captured.hidden.shape[0] == key.num_tokens
        assert host_sync_ops(lambda: engine.runner.forward_contexts.prepare_lora(captured.batch)) == []
        calls.clear()
        assert host_sync_ops(captured.graph.fn) == [], key
        assert len(calls) == (4 * engine.model_config.num_layers if key.has_lora else 0) and all(calls)


def grounded_requests(adapters, num_requests: int = 10, seed: int = 0, max_tokens: int = 12) -> list[tuple]:
    """Prompts repeating a motif (the n-gram proposes drafts), on the base model and two adapters."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    requests = []
    for i in range(num_requests):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(2, 4))]
        name = (None, "r4", "r8-rslora")[i % 3]
        requests.append((f"s{i}", (motif * 8)[:rng.randint(8, 20)], params,
                         LoRARequest(name, adapters[name][0]) if name else None))
    return requests


def check_same(eager, graphed, tol: float) -> None:
    assert eager.keys() == graphed.keys()
    for request_id, out in eager.items():
        want, got = out.outputs[0], graphed[request_id].outputs[0]
        assert got.token_ids == want.token_ids, request_id
        for step, token in enumerate(want.token_ids):
            assert abs(got.logprobs[step][token] - want.logprobs[step][token]) <= tol, (request_id, step)


def test_engine_verify_steps_replay_graphs_and_match_eager(engine_checkpoint):
    """Greedy requests on the base model and two LoRAs, n-gram drafts: the verify steps replay the
    emulated verify graphs (padded to K + 1 tokens per sequence) and every token and logprob equals the
    eager speculating engine's."""
    path, _, adapters = engine_checkpoint
    requests = grounded_requests(adapters)
    eager = run_to_completion(LLMEngine(path, device="cpu", **ENGINE), requests, per_step=None)
    engine = graphed_spec_engine(path)
    graphs = engine.runner.decode_graphs
    replayed = []
    replay = graphs.replay
    graphs.replay = lambda key, padded: replayed.append(key) or replay(key, padded)
    graphed = run_to_completion(engine, requests, per_step=None)
    check_same(eager, graphed, 1e-4)
    assert engine.stats.spec_decode.num_accepted_tokens > 0
    verify = [key for key in replayed if key.tokens_per_seq == K + 1]
    assert len(verify) >= 5 and any(key.has_lora for key in verify)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_cuda_verify_graphs_at_start_up_match_eager(engine_checkpoint, method):
    """On CUDA the engine captures the verify graphs at start-up (k from speculative_config; with a draft
    model the draft's forwards too, its memory in the profiled budget); tokens and logprobs equal an
    enforce_eager engine's (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, _, adapters = engine_checkpoint
    spec = dict(ENGINE["speculative_config"]) if method == "ngram" else {
        "method": "draft_model", "model": path, "num_speculative_tokens": K, "min_acceptance_rate": 0}
    cuda = dict(ENGINE, speculative_config=spec)
    requests = grounded_requests(adapters, num_requests=12, seed=1, max_tokens=24)
    eager = run_to_completion(LLMEngine(path, device="cuda", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                                        **cuda), requests, per_step=None)
    engine = LLMEngine(path, device="cuda", gpu_memory_utilization=0.5, **cuda)  # the memory profile's budget
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.plan.verify_tokens_per_seq == K + 1
    check_same(eager, run_to_completion(engine, requests, per_step=None), 1e-3)
    assert graphs.num_verify_replays >= 3 and engine.stats.spec_decode.num_accepted_tokens > 0
    if method == "draft_model":
        draft = engine.scheduler.speculator.proposer.forward
        assert draft.graphs is not None and draft.graphs.pool is graphs.pool and draft.graphs.num_replays > 0


# ------------------------------------------------------------------ start-up memory: verify step, draft model
def test_profile_steps_add_the_largest_verify_step():
    steps = profile_steps(max_num_seqs=64, max_num_batched_tokens=100, max_model_len=48, block_size=4,
                          lora_slots=[0, 1], verify_tokens_per_seq=K + 1)
    verify = steps["verify"]
    assert len(verify) == 100 // (K + 1) and all(c.num_new_tokens == K + 1 for c in verify)
    builder = BatchBuilder(max_num_tokens=100, max_num_seqs=64, max_blocks_per_seq=12, block_size=4, device="cpu")
    batch = builder.build(verify)
    assert batch.max_query_len == K + 1 and batch.max_seq_len == 48  # at full context, within the buffers
    assert DecodeGraphPlan(64, verify_tokens_per_seq=K + 1, max_num_tokens=100).verify_sizes[-1] == len(verify)
    assert "verify" not in profile_steps(max_num_seqs=64, max_num_batched_tokens=100, max_model_len=48, block_size=4,
                                         lora_slots=[0])


def test_draft_model_is_loaded_once_at_start_up(engine_checkpoint, monkeypatch):
    """The "uni" start-up loads the draft before the memory profile and the engine's speculator runs that
    model (loading it again would hold two copies, one of them never counted)."""
    from lora_runner.worker import draft_runner

    loads = []
    load_model = draft_runner.load_model
    monkeypatch.setattr(draft_runner, "load_model", lambda *args, **kwargs: loads.append(args) or load_model(
        *args, **kwargs))
    path = engine_checkpoint[0]
    engine = LLMEngine(path, device="cpu", max_model_len=64, max_num_seqs=2,
                       speculative_config={"method": "draft_model", "model": path, "num_speculative_tokens": 2})
    assert len(loads) == 1
    speculator = engine.scheduler.speculator.proposer
    done = run_to_completion(engine, [("d", [5, 6, 7, 5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6))])
    assert len(done["d"].outputs[0].token_ids) == 6 and speculator.num_forwards > 0
    assert engine.stats.draft_forwards == speculator.num_forwards


def test_draft_model_forwards_replay_graphs_and_propose_as_eager(engine_checkpoint):
    """The draft's forwards replay emulated graphs (the feed-back forwards decode graphs, short catch-ups
    verify graphs; no request names a draft adapter, so the graphs without LoRA): the same proposals, hence
    the same drafts, acceptance and tokens as an engine whose draft runs eagerly; requests on an adapter
    beside base ones."""
    path, _, adapters = engine_checkpoint
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": K, "min_acceptance_rate": 0}
    requests = grounded_requests(adapters, num_requests=6, seed=2, max_tokens=30)
    engines = [LLMEngine(path, device="cpu", **dict(ENGINE, speculative_config=spec)) for _ in range(2)]
    draft = engines[1].scheduler.speculator.proposer.forward
    draft.capture_graphs(K, make_graph=RerunGraph)
    keys = draft.graphs.plan.keys()
    assert len(draft.graphs) == len(keys) and any(key.has_lora for key in keys)  # the engine's draft adapters
    eager, graphed = (run_to_completion(engine, requests, per_step=None) for engine in engines)
    check_same(eager, graphed, 1e-4)
    want, got = engines[0].stats.spec_decode, engines[1].stats.spec_decode
    assert (got.num_draft_tokens, got.num_accepted_tokens) == (want.num_draft_tokens, want.num_accepted_tokens)
    assert got.num_accepted_tokens > 0
    assert draft.graphs.num_verify_replays > 0 and draft.graphs.num_replays > draft.graphs.num_verify_replays
    assert draft.num_eager_fallbacks == 0
