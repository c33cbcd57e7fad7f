"""Host work per LoRA step and skipped work (issue 26, items 4-6).

* The LoRA meta's segment / tile table is built on the host (punica_kernels.host_tiles, the one builder)
  and sent in the step's one staged upload: it equals a plain loop over the slots, the Triton kernels
  (interpreter) read it unchanged, and preparing the meta on the engine path issues no aten op at all
  (counted with a dispatch mode on every op, not timed); the upload stays one copy, the lm_head LoRA's
  table over the sampled rows included.
* Decode steps run one add_lora per packed module (2 launches), no embedding-LoRA gather/expand when no
  adapter of the step has one and no DoRA column scales when none has DoRA; graphs are keyed by it, and
  tokens and logprobs equal the engine that runs every optional part, for mixed batches.
* benchmarks/lora_decode_profile.py --smoke runs on CPU and writes its table's JSON.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import punica_kernels
from adapters import LoRARequest
from factories import save_lora
from lora_runner import SamplingParams
from lora_runner.model.forward_context import ALL_LORA_FEATURES, PLAIN_LORA, LoRAFeatures
from lora_runner.model.vocab_lora import LMHeadLoRA
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.cuda_graphs import DecodeGraphKey, DecodeGraphPlan, RerunGraph
from lora_runner.worker.forward_context_builder import ForwardContextBuilder
from lora_runner.worker.lora_features import StepLoRAFeatures
from punica_kernels import HostTileTable, LoRAMeta, load_table
from engine_support import make_engine, run_to_completion
from test_dora import save_dora

ROOT = Path(__file__).resolve().parent.parent


class AtenOps(TorchDispatchMode):
    """Records every aten op dispatched inside it, views apart (no kernel: a new header on the same bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.views: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        (self.views if func.is_view else self.ops).append(str(func))
        return func(*args, **(kwargs or {}))


def random_slots(rng: random.Random, num_tokens: int, max_loras: int) -> np.ndarray:
    """Token slots with runs (prefill chunks), scattered decode tokens and -1 (base) tokens."""
    slots = []
    while len(slots) < num_tokens:
        slots += [rng.choice([-1, *range(max_loras)])] * rng.choice([1, 1, 3, 17, 40])
    return np.array(slots[:num_tokens], dtype=np.int64)


# ---------------------------------------------------------------- item 4: the table, on the host

def loop_table(slots: np.ndarray, max_loras: int, block_m: int) -> tuple[list[int], list[int], list[tuple]]:
    """The table by a plain loop: (sorted tokens, slot starts, (slot, start, end) of each tile with work)."""
    sorted_tokens, starts, tiles = [], [], []
    for slot in [*range(max_loras), None]:  # None: the tokens without an adapter, last
        starts.append(len(sorted_tokens))
        mine = [t for t, s in enumerate(slots.tolist()) if (s == slot if slot is not None else not 0 <= s < max_loras)]
        if slot is not None:
            tiles += [(slot, len(sorted_tokens) + i, len(sorted_tokens) + min(i + block_m, len(mine)))
                      for i in range(0, len(mine), block_m)]
        sorted_tokens += mine
    return sorted_tokens, starts + [len(sorted_tokens)], tiles


@pytest.mark.parametrize("seed", range(6))
def test_host_table_equals_a_loop_over_the_slots(seed):
    rng = random.Random(seed)
    max_loras, block_m = rng.choice([1, 3, 8]), rng.choice([16, 32])
    meta = LoRAMeta(128, max_loras, block_m=block_m)
    table = HostTileTable(meta)
    for _ in range(3):  # reuse: a bigger batch's stale tiles must not survive
        slots = random_slots(rng, rng.randint(1, 128), max_loras)
        slots[rng.randrange(slots.shape[0])] = max_loras + 2  # out of range: no adapter, as -1
        arrays = table.build(slots)
        sorted_tokens, starts, tiles = loop_table(slots, max_loras, block_m)
        num_tokens = slots.shape[0]
        np.testing.assert_array_equal(arrays[0], slots)
        assert arrays[1].tolist() == sorted_tokens and arrays[2].tolist() == starts == table.host_slot_starts
        work = arrays[3] >= 0
        assert list(zip(arrays[3][work].tolist(), arrays[4][work].tolist(), arrays[5][work].tolist())) == tiles
        assert work[:len(tiles)].all() and (arrays[4][~work] == arrays[5][~work]).all()  # the rest: empty
        assert len(tiles) <= meta.max_tiles(num_tokens)  # the kernels' grid covers every tile with work
        assert [a.dtype for a in arrays] == [np.int64] * 3 + [np.int32] * 3
        assert [a.shape[0] for a in arrays] == [num_tokens, num_tokens, max_loras + 2] + [meta.max_tile_count] * 3


def lora_rig(max_loras=3, staged=True):
    """A staged CPU batch builder carrying the table of a LoRA meta, and the contexts that read it."""
    meta = LoRAMeta(256, max_loras, max_rank=16, max_slices=3)
    builder = BatchBuilder(max_num_tokens=256, max_num_seqs=32, max_blocks_per_seq=8, block_size=4, device="cpu",
                           staged=staged, lora_table=HostTileTable(meta))
    slots = type("Slots", (), {})()
    slots.slot_ranks = torch.tensor([4, 16, 8, 0][:max_loras], dtype=torch.int32)
    contexts = ForwardContextBuilder(torch.zeros(1), meta, slots)
    return meta, builder, contexts


def chunks_on(rng: random.Random, slots: list[int], max_len: int = 16) -> list[SeqChunk]:
    """One chunk per entry of slots: a prefill of up to max_len tokens or a decode token, on that LoRA slot."""
    chunks = []
    for slot in slots:
        total = rng.randint(2, max_len)
        new = rng.choice([1, total])
        chunks.append(SeqChunk(token_ids=[rng.randrange(100) for _ in range(total)], start=total - new,
                               num_new_tokens=new, block_table=list(range(1, 9)), lora_slot=slot))
    return chunks


def test_engine_path_prepares_the_meta_with_no_device_op_and_one_copy():
    """Issue 26 counted 33 eager device ops in the device-side table build (now gone) before each replay;
    the table rides in the step's one upload and prepare_lora only points the meta at it."""
    rng = random.Random(0)
    meta, builder, contexts = lora_rig()
    step = builder.write(chunks_on(rng, [0, -1, 2, 1, 0, 2]))
    with AtenOps() as upload:
        batch = builder.upload(step)
    assert upload.ops == ["aten.copy_.default"]  # the staged upload's one copy, table included
    with AtenOps() as prepared:
        contexts.prepare_lora(batch)
    assert prepared.ops == [] and prepared.views == []
    assert meta.slot_ranks is contexts.lora_slots.slot_ranks  # read in place: no copy either
    device = builder.staging.device_bytes
    for view in batch.lora_table.arrays:  # inside the one device buffer the copy wrote
        assert device.data_ptr() <= view.data_ptr() < device.data_ptr() + device.numel()
    assert meta.sorted_tokens is batch.lora_table.arrays[1] and meta.num_tokens == batch.num_tokens


def test_a_lora_step_needs_its_table():
    meta = LoRAMeta(64, 3)
    builder = BatchBuilder(max_num_tokens=64, max_num_seqs=4, max_blocks_per_seq=8, block_size=4, device="cpu")
    contexts = ForwardContextBuilder(torch.zeros(1), meta, type("Slots", (), {"slot_ranks": None})())
    with pytest.raises(ValueError, match="no LoRA table"):
        contexts.prepare_lora(builder.build(chunks_on(random.Random(0), [0, -1])))


def test_uploaded_table_feeds_the_triton_kernels_unchanged():
    """add_lora through the Triton interpreter on the meta pointed at the staged views equals the float64
    reference on a prepared meta (NaN-poisoned rows of base tokens stay NaN: never written)."""
    rng = random.Random(1)
    meta, builder, contexts = lora_rig()
    chunks = chunks_on(rng, [1, -1, 0, 2, 1, -1, 0], max_len=32)
    chunks[0].token_ids = [rng.randrange(100) for _ in range(30)]  # a whole prefill: slot 1 spans 2+ tiles
    chunks[0].start, chunks[0].num_new_tokens = 0, 30
    batch = builder.build(chunks)
    assert (batch.lora_table.arrays[3] == 1).sum() >= 2
    contexts.prepare_lora(batch)
    num_tokens, in_features, sizes, rank = batch.num_tokens, 32, (32, 16, 16), 16
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, in_features, generator=gen)
    lora_a = torch.randn(3, len(sizes), rank, in_features, generator=gen) * 0.1
    lora_b = torch.randn(3, sum(sizes), rank, generator=gen) * 0.1
    y = torch.randn(num_tokens, sum(sizes), generator=gen)
    base_rows = batch.token_lora_slots < 0
    y[base_rows] = float("nan")
    got = punica_kernels.add_lora(y.clone(), x, lora_a, lora_b, meta, sizes, backend="triton")
    oracle = LoRAMeta(256, 3)
    load_table(oracle, batch.token_lora_slots.clone(), contexts.lora_slots.slot_ranks.clone())
    want = punica_kernels.add_lora(y.double(), x.double(), lora_a.double(), lora_b.double(), oracle, sizes,
                                   backend="torch")
    assert torch.isnan(got[base_rows]).all()
    torch.testing.assert_close(got[~base_rows].double(), want[~base_rows], rtol=1e-5, atol=1e-5)


def test_padded_decode_steps_of_one_size_put_the_table_where_the_capture_did():
    rng = random.Random(2)
    _, builder, _ = lora_rig()
    capture = builder.padding_batch(8, lora_slot=0)
    for num_seqs in (1, 5, 8):
        step = builder.write(chunks_on(rng, [rng.choice([-1, 0, 1, 2]) for _ in range(num_seqs - 1)] + [1]))
        if step.max_query_len != 1:
            continue
        padded = builder.upload(step, padded_seqs=8)
        assert [v.data_ptr() for v in padded.lora_table.arrays] == [v.data_ptr() for v in capture.lora_table.arrays]


class HeadSlots:
    """VocabLoRASlots' lm_head bookkeeping as LMHeadLoRA reads it: slots 0 and 2 hold an lm_head LoRA."""

    def __init__(self, ranks=(4, 0, 8)) -> None:
        self.host_lm_head_ranks = np.array(ranks, dtype=np.int32)
        self.lm_head_ranks = torch.tensor(ranks, dtype=torch.int32)

    def lm_head_in_use(self) -> bool:
        return bool(self.host_lm_head_ranks.any())


def test_lm_head_table_rides_last_in_the_same_copy():
    """The sampled rows' lm_head table: built on the host, rows whose adapter has no lm_head LoRA on -1,
    in the step's one copy after every other field (the graph-read ones do not move), read in place."""
    rng = random.Random(4)
    slots = HeadSlots()
    lm_head = LMHeadLoRA(slots, max_rows=32, max_loras=3, max_lora_rank=8, device="cpu")
    meta = LoRAMeta(256, 3, max_rank=16, max_slices=3)
    builder = BatchBuilder(max_num_tokens=256, max_num_seqs=32, max_blocks_per_seq=8, block_size=4, device="cpu",
                           staged=True, lora_table=HostTileTable(meta), lm_head=lm_head)
    chunks = chunks_on(rng, [0, -1, 2, 1, 0])
    step = builder.write(chunks)
    with AtenOps() as upload:
        batch = builder.upload(step)
    assert upload.ops == ["aten.copy_.default"]
    rows = batch.lm_head_table.arrays
    assert rows[0].tolist() == [0, -1, 2, -1, 0]  # slot 1 has no lm_head LoRA: skipped like a base row
    assert all(view.data_ptr() > batch.sample_indices.data_ptr() for view in rows)
    with AtenOps() as pointed:
        context = lm_head.context(batch.lm_head_table)
    assert pointed.ops == [] and context.meta is lm_head.meta and lm_head.meta.slot_ranks is slots.lm_head_ranks
    oracle = LoRAMeta(32, 3)
    load_table(oracle, torch.tensor([0, -1, 2, -1, 0]))
    assert [a.tolist() for a in (oracle.token_slots, oracle.sorted_tokens, oracle.slot_starts)] == [
        a.tolist() for a in rows[:3]]
    slots.host_lm_head_ranks = np.array([0, 4, 0], dtype=np.int32)  # only slot 1 (row 3's adapter) has one now
    again = builder.upload(step)
    assert again.lm_head_table.arrays[0].tolist() == [-1, -1, -1, 1, -1]
    assert again.block_tables.data_ptr() == batch.block_tables.data_ptr()
    assert [v.data_ptr() for v in again.lora_table.arrays] == [v.data_ptr() for v in batch.lora_table.arrays]
    slots.host_lm_head_ranks = np.zeros(3, dtype=np.int32)
    plain = builder.upload(step)
    assert plain.lm_head_table is None and lm_head.context(plain.lm_head_table) is None
    assert plain.block_tables.data_ptr() == batch.block_tables.data_ptr()


def test_prompt_rows_get_their_lm_head_table_from_the_host_builder():
    slots = HeadSlots()
    lm_head = LMHeadLoRA(slots, max_rows=8, max_loras=3, max_lora_rank=8, device="cpu")
    token_slots = np.array([1, 0, 0, 2, -1, 2], np.int64)
    context = lm_head.context_for_rows(token_slots, torch.tensor([2, 3, 4, 5, 0]))
    assert context.meta.token_slots.tolist() == [0, 2, -1, 2, -1]
    assert context.meta.tile_slots[:2].tolist() == [0, 2] and context.meta.slot_ranks is slots.lm_head_ranks
    assert lm_head.context_for_rows(token_slots, torch.tensor([0, 4])) is None  # slot 1 and base: none


# ---------------------------------------------------------------- item 5: work nobody needs

def test_step_features_and_graph_keys():
    lora_slots = type("S", (), {"host_dora": np.array([False, True, False])})()
    vocab_slots = type("V", (), {"host_embedding": np.array([False, False, True])})()
    features = StepLoRAFeatures(lora_slots, vocab_slots)
    assert features(np.array([0, -1, 0])) == PLAIN_LORA
    assert features(np.array([0, 1])) == LoRAFeatures(embedding=False, dora=True)
    assert features(np.array([2, -1])) == LoRAFeatures(embedding=True, dora=False)
    assert StepLoRAFeatures(lora_slots)(np.array([2, 1])) == LoRAFeatures(embedding=False, dora=True)
    plan = DecodeGraphPlan(8, full_lora=LoRAFeatures(embedding=False, dora=True))  # no vocab slots served
    decode = dict(num_tokens=3, num_seqs=3, num_samples=3, max_query_len=1, max_seq_len=4, has_prompt_adapter=False)
    from lora_runner.worker.batch_builder import BatchShape

    assert plan.key_for(BatchShape(**decode, has_lora=True, lora_features=PLAIN_LORA)) == DecodeGraphKey(4, True)
    dora = BatchShape(**decode, has_lora=True, lora_features=LoRAFeatures(embedding=False, dora=True))
    assert plan.key_for(dora) == DecodeGraphKey(4, True, plan.full_lora)
    assert plan.key_for(BatchShape(**decode, has_lora=True, lora_features=ALL_LORA_FEATURES)) is None  # no graph has it


@pytest.fixture(scope="module")
def mixed_checkpoint(engine_checkpoint, tmp_path_factory):
    """The engine checkpoint's plain adapters plus an embed_tokens LoRA and a DoRA adapter on its base."""
    path, hf, adapters = engine_checkpoint
    root = tmp_path_factory.mktemp("lora-step")
    extra = {"embed": save_lora(hf, root / "embed", seed=31, r=4, lora_alpha=8, scale=0.2,
                                target_modules=["embed_tokens", "q_proj"]),
             "dora": save_dora(hf, root / "dora", seed=32, r=8, lora_alpha=16)}
    return path, {**{name: adapters[name][0] for name in adapters}, **{name: str(root / name) for name in extra}}


class PunicaCalls:
    """Wraps punica_kernels' entry points the model calls (layers and vocab_lora look them up there)."""

    def __init__(self, monkeypatch) -> None:
        self.add_lora, self.embedding = [], 0
        real_add, real_shrink = punica_kernels.add_lora, punica_kernels.embedding_shrink

        def add_lora(*args, column_scales=None, **kwargs):
            self.add_lora.append(column_scales is not None)
            return real_add(*args, column_scales=column_scales, **kwargs)

        def embedding_shrink(*args, **kwargs):
            self.embedding += 1
            return real_shrink(*args, **kwargs)

        monkeypatch.setattr(punica_kernels, "add_lora", add_lora)
        monkeypatch.setattr(punica_kernels, "embedding_shrink", embedding_shrink)

    def take(self) -> tuple[int, int, int]:
        """(add_lora calls, of them with column scales, embedding shrinks) since the last take."""
        counts = (len(self.add_lora), sum(self.add_lora), self.embedding)
        self.add_lora, self.embedding = [], 0
        return counts


def graphed(path: str, adapters: dict[str, str]):
    engine = make_engine(path, max_loras=4, max_cpu_loras=8, max_num_seqs=4, poison=("vocab_slots",))
    engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    for name in ("embed", "dora", "r4", "r8-qv"):  # all resident from the start
        engine.add_lora(LoRARequest(name, adapters[name]))
    return engine


BATCHES = [("r4", "r8-qv", None), ("r4", "embed", None), ("dora", "r8-qv", None), ("embed", "dora", "r4")]


@pytest.mark.parametrize("names", BATCHES, ids=["plain", "embed", "dora", "both"])
def test_decode_steps_launch_only_the_lora_work_their_adapters_have(mixed_checkpoint, monkeypatch, names):
    path, adapters = mixed_checkpoint
    engine = graphed(path, adapters)
    calls = PunicaCalls(monkeypatch)
    layers = engine.model_config.num_layers
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, name in enumerate(names):
        engine.add_request(f"q{i}", [5 + i, 17, 30, 4], params, lora_request=LoRARequest(name, adapters[name])
                           if name else None)
    engine.step()  # the prefill
    calls.take()
    graphs = engine.runner.decode_graphs
    embedding, dora = "embed" in names, "dora" in names
    for _ in range(3):
        replays = graphs.num_replays
        engine.step()
        assert graphs.num_replays == replays + 1  # a decode graph served the step
        lora_calls, with_column_scales, embedding_shrinks = calls.take()
        assert lora_calls == 4 * layers  # one add_lora (a shrink and an expand) per packed module
        assert with_column_scales == (lora_calls if embedding or dora else 0)  # the full graph runs both
        assert embedding_shrinks == (1 if embedding or dora else 0)


def test_skipping_changes_no_token_or_logprob(mixed_checkpoint, monkeypatch):
    """Against the same graphed engine told every step needs all optional work (the code before)."""
    path, adapters = mixed_checkpoint
    rng = random.Random(3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    requests = []
    for batch, names in enumerate(BATCHES):
        for i, name in enumerate(names):
            prompt = [rng.randrange(3, 256) for _ in range(rng.randint(2, 12))]
            requests.append((f"b{batch}-{i}", prompt, params, LoRARequest(name, adapters[name]) if name else None))
    skipping = graphed(path, adapters)
    got = {}
    for batch in range(len(BATCHES)):  # batch by batch: each step holds one mix
        got.update(run_to_completion(skipping, [r for r in requests if r[0].startswith(f"b{batch}-")]))
    monkeypatch.setattr(StepLoRAFeatures, "__call__", lambda self, seq_slots: ALL_LORA_FEATURES)
    everything = graphed(path, adapters)
    want = {}
    for batch in range(len(BATCHES)):
        want.update(run_to_completion(everything, [r for r in requests if r[0].startswith(f"b{batch}-")]))
    for request_id, out in want.items():
        expected, completion = out.outputs[0], got[request_id].outputs[0]
        assert completion.token_ids == expected.token_ids, request_id
        for lp, expected_lp in zip(completion.logprobs, expected.logprobs):
            assert lp.keys() == expected_lp.keys()
            assert all(abs(lp[t] - expected_lp[t]) <= 1e-6 for t in lp), (request_id, lp, expected_lp)


# ---------------------------------------------------------------- item 6: the device profile script

def test_profile_script_smoke_writes_its_table(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "lora_decode_profile.py"), "--smoke",
                           "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert {"kernels", "prepare", "decode", "prefill"} <= results.keys()
    assert results["prepare"]["host_table_device_ops"] == 0
    decode = {(row["requests"], row["adapters"]): row for row in results["decode"]}
    assert decode.keys() == {(r, a) for r in (8, 32, 128) for a in (0, 8, 32)} or results["smoke"]
    assert all(row["tokens_per_s"] > 0 and row["ratio_to_base"] > 0 for row in results["decode"])
    assert all(row["tokens_per_s"] > 0 for row in results["prefill"])
    assert "| requests |" in proc.stdout
