"""InputBatch: persistent request rows, updated as diffs, against a from-scratch rebuild every step."""

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from lora_runner.core.block_manager import BlockManager
from lora_runner.core.scheduler_output import SchedulerOutput
from lora_runner.worker.batch_builder import BatchBuilder, SeqChunk
from lora_runner.worker.request_rows import InputBatch, RowsOutOfSyncError

FIELDS = ("input_ids", "positions", "slot_mapping", "token_lora_slots", "query_start_loc", "seq_lens",
          "block_tables", "sample_indices", "token_prompt_slots", "token_prompt_positions")
POISON = -12345


@dataclass(eq=False)
class FakeRequest:
    """The fields of lora_runner.core.request.Request the rows read."""

    request_id: str
    token_ids: list[int]
    lora_ref: object = None
    prompt_adapter_ref: object = None
    num_virtual_tokens: int = 0
    num_computed: int = 0
    params: object = None  # sampling settings: these rows keep none
    generator: object = None
    num_prompt_tokens: int = 0


@dataclass
class Chunk:
    """A ScheduledRequest look-alike."""

    request: FakeRequest
    start: int
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        return self.start + self.num_new_tokens == len(self.request.token_ids)


@dataclass
class Sim:
    """A tiny scheduler over a real BlockManager: random admissions, chunked prefills, decodes,
    finishes, preemptions, skipped steps and id reuse, told to the rows as a SchedulerOutput (new
    requests in full, continuing ones as block diffs); `lie` drops some preemption notices."""

    rng: random.Random
    max_num_seqs: int = 6
    block_size: int = 4
    width: int = 8
    max_chunk: int = 7
    lie: bool = False
    blocks: BlockManager = None
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)
    freed: list = field(default_factory=list)
    next_id: int = 0

    def __post_init__(self):
        self.blocks = BlockManager(self.max_num_seqs * self.width, self.block_size)

    def new_request(self):
        rng = self.rng
        num_virtual = rng.choice([0, 0, 0, 3])
        prompt = [0] * num_virtual + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
        request_id = f"r{rng.randrange(self.next_id + 1)}"  # ids are reused once their request is gone
        if any(r.request_id == request_id for r in self.running + self.waiting):
            request_id = f"r{self.next_id}-new"
        self.next_id += 1
        return FakeRequest(request_id, prompt, lora_ref=rng.choice([None, "a", "b", "c", ("d", 2)]),
                           prompt_adapter_ref=rng.choice(["p", "q"]) if num_virtual else None,
                           num_virtual_tokens=num_virtual)

    def remove(self, request, notify=True):
        self.running.remove(request)
        self.blocks.free(request.request_id)
        if notify:
            self.freed.append(request.request_id)

    def events(self):
        rng = self.rng
        for request in list(self.running):
            roll = rng.random()
            if roll < 0.1:  # finished or aborted
                self.remove(request)
            elif roll < 0.18:  # preempted: recomputes everything later
                self.remove(request, notify=not (self.lie and rng.random() < 0.5))
                request.num_computed = 0
                self.waiting.insert(0, request)
        for _ in range(rng.randint(0, 3)):
            self.waiting.append(self.new_request())

    def schedule(self):
        """This step's chunks (in batch order) and the SchedulerOutput that tells the rows about them."""
        rng, entries = self.rng, []
        for request in self.running:
            if rng.random() < 0.15:
                continue  # running but not scheduled this step
            entries.append((False, *self.chunk_of(request)))
        while self.waiting and len(self.running) < self.max_num_seqs and rng.random() < 0.8:
            request = self.waiting.pop(0)
            self.running.append(request)
            entries.append((True, *self.chunk_of(request)))
        rng.shuffle(entries)  # batch order is the scheduler's, not the rows'
        out = SchedulerOutput(finished_ids=self.freed)
        self.freed = []
        for is_new, chunk, new_blocks in entries:
            if is_new:
                out.add_new(chunk, self.blocks.table(chunk.request.request_id))
            else:
                out.add_continuing(chunk, new_blocks)
        return [chunk for _, chunk, _ in entries], out

    def chunk_of(self, request):
        left = len(request.token_ids) - request.num_computed
        num_new = min(left, self.rng.randint(1, self.max_chunk))
        end = request.num_computed + num_new
        assert end <= self.width * self.block_size, "test sizes keep requests inside the table"
        new_blocks = self.blocks.allocate(request.request_id, end)
        return Chunk(request, request.num_computed, num_new), new_blocks

    def slots(self, chunks, kind):
        refs = {getattr(c.request, kind) for c in chunks} - {None}
        return {ref: self.rng.randrange(4) for ref in refs}  # slots may move between steps

    def run(self, chunks, sampled):
        """The step ran: count computed tokens, append each sampling chunk's sampled tokens, finish
        long requests."""
        for chunk, tokens in zip([c for c in chunks if c.samples], sampled):
            chunk.request.token_ids.extend(tokens)
        for chunk in chunks:
            chunk.request.num_computed += chunk.num_new_tokens
            if len(chunk.request.token_ids) >= self.width * self.block_size - 1:
                self.remove(chunk.request)


def reference_chunks(sim, chunks, lora_slot_of, prompt_slot_of):
    return [SeqChunk(token_ids=c.request.token_ids, start=c.start, num_new_tokens=c.num_new_tokens,
                     block_table=sim.blocks.table(c.request.request_id),
                     lora_slot=lora_slot_of.get(c.request.lora_ref, -1), sample=c.samples,
                     prompt_adapter_slot=prompt_slot_of.get(c.request.prompt_adapter_ref, -1),
                     num_virtual_tokens=c.request.num_virtual_tokens) for c in chunks]


def builders(sim):
    sizes = dict(max_num_tokens=sim.max_num_seqs * sim.max_chunk, max_num_seqs=sim.max_num_seqs,
                 max_blocks_per_seq=sim.width, block_size=sim.block_size, device="cpu")
    return BatchBuilder(**sizes), BatchBuilder(**sizes)


def poison_builder(builder):
    for name in FIELDS:
        getattr(builder, name).cpu.fill_(POISON)


def poison_free_rows(rows):
    """Garbage in every free row: a row written for a new request must not show any of it."""
    free = [r for r in range(rows.max_num_seqs) if rows.request_ids[r] is None]
    rows.token_ids[free] = POISON
    rows.block_tables[free] = POISON
    rows.num_tokens[free] = 10**6
    rows.num_computed[free] = 7
    rows.num_blocks[free] = 10**6


def assert_same_batch(got, want):
    for name in FIELDS:
        expected, actual = getattr(want, name), getattr(got, name)
        if expected is None:
            assert actual is None, name
        else:
            assert torch.equal(actual, expected), name
    assert (got.max_query_len, got.max_seq_len, got.has_lora) == (want.max_query_len, want.max_seq_len,
                                                                  want.has_lora)


def run_steps(seed, steps=60, max_sampled=1, **sim_args):
    """Random steps; the rows' batch must equal a from-scratch rebuild from the requests every step."""
    rng = random.Random(seed)
    sim = Sim(rng, **sim_args)
    rows = InputBatch(max_num_seqs=sim.max_num_seqs, max_blocks_per_seq=sim.width, block_size=sim.block_size)
    incremental, scratch = builders(sim)
    num_steps = 0
    for _ in range(steps):
        sim.events()
        chunks, out = sim.schedule()
        if not chunks:
            for request_id in out.left_ids:  # what ModelRunner.forget does
                rows.free(request_id)
            continue
        lora_slot_of, prompt_slot_of = sim.slots(chunks, "lora_ref"), sim.slots(chunks, "prompt_adapter_ref")
        poison_free_rows(rows)
        poison_builder(incremental)
        step = rows.update(out, lora_slot_of, prompt_slot_of)
        got = incremental.upload(incremental.write_rows(rows.token_ids, rows.block_tables, step.rows, step.starts,
                                                        step.lens, step.seqs))
        want = scratch.build(reference_chunks(sim, chunks, lora_slot_of, prompt_slot_of))
        assert_same_batch(got, want)
        # a list per sampling chunk: one token, or up to max_sampled (a multi-token step)
        sampled = [[rng.randrange(1, 500) for _ in range(rng.randint(1, max_sampled) if max_sampled > 1 else 1)]
                   for c in chunks if c.samples]
        rows.commit(step, sampled)
        sim.run(chunks, sampled)
        num_steps += 1
    assert num_steps > steps // 2
    return sim, rows


@pytest.mark.parametrize("seed", range(6))
def test_rows_equal_a_rebuild_over_random_adds_continues_finishes_preemptions(seed):
    sim, rows = run_steps(seed)
    for request in sim.running:  # the rows mirror the requests they hold
        row = rows.row_of(request.request_id)
        if row is not None:
            held = int(rows.num_tokens[row])
            assert rows.token_ids[row, :held].tolist() == request.token_ids[:held]
            assert int(rows.num_computed[row]) == request.num_computed


@pytest.mark.parametrize("seed", range(3))
def test_rows_equal_a_rebuild_with_several_sampled_tokens_per_row(seed):
    """Steps that sample 1 to 3 tokens per row (speculative decoding's verified tokens): each row
    holds all of them, uncomputed until later chunks compute them, and the batch still equals a rebuild."""
    sim, rows = run_steps(200 + seed, max_sampled=3)
    for request in sim.running:
        row = rows.row_of(request.request_id)
        assert int(rows.num_tokens[row]) == len(request.token_ids)
        assert rows.token_ids[row, :len(request.token_ids)].tolist() == request.token_ids
        assert int(rows.num_computed[row]) == request.num_computed


def test_commit_appends_each_rows_token_list_in_order():
    rows = InputBatch(max_num_seqs=3, max_blocks_per_seq=2, block_size=4)
    a, b, c = FakeRequest("a", [1, 2, 3]), FakeRequest("b", [4, 5]), FakeRequest("c", [6, 7, 8, 9, 10, 11])
    step = one_step(rows, (True, a, 0, 3, [0]), (True, b, 0, 2, [1]), (True, c, 0, 6, [2, 3]))
    rows.commit(step, [[20, 21, 22], [], [30, 31, 32, 33]])  # b's row failed: it gets no token
    held = {r.request_id: rows.token_ids[rows.row_of(r.request_id), :rows.num_tokens[rows.row_of(r.request_id)]]
            for r in (a, b, c)}
    assert {k: v.tolist() for k, v in held.items()} == {
        "a": [1, 2, 3, 20, 21, 22], "b": [4, 5],
        "c": [6, 7, 8, 9, 10, 11, 30, 31, 32]}  # c's row holds 2 * 4 + 1 tokens: the 4th is past max_model_len
    assert [int(rows.num_computed[rows.row_of(r)]) for r in "abc"] == [3, 2, 6]
    step = one_step(rows, (False, a, 3, 3, [4]))  # the sampled tokens are computed by the next chunk
    assert step.seqs.sample.tolist() == [True]
    rows.commit(step, [[23]])
    assert rows.token_ids[rows.row_of("a"), :7].tolist() == [1, 2, 3, 20, 21, 22, 23]
    assert int(rows.num_computed[rows.row_of("a")]) == 6


@pytest.mark.parametrize("seed", range(3))
def test_a_missed_preemption_notice_raises(seed):
    """A preempted request whose notice never came is sent as new while its row is still held: the
    rows raise instead of rewriting the row."""
    with pytest.raises(RowsOutOfSyncError, match="is new to the scheduler but has row"):
        run_steps(100 + seed, steps=200, lie=True)


def one_step(rows, *entries, finished=()):
    """rows.update of one step; entries: (is_new, request, start, num_new_tokens, block ids)."""
    out = SchedulerOutput(finished_ids=list(finished))
    for is_new, request, start, num_new, blocks in entries:
        (out.add_new if is_new else out.add_continuing)(Chunk(request, start, num_new), blocks)
    return rows.update(out)


def test_rows_raise_when_the_output_disagrees_with_them():
    rows = InputBatch(max_num_seqs=2, max_blocks_per_seq=3, block_size=4)
    a, b = FakeRequest("a", [1, 2, 3, 4, 5]), FakeRequest("b", [6, 7])
    rows.commit(one_step(rows, (True, a, 0, 5, [3, 4])), [[9]])  # a holds 6 tokens, 5 computed, blocks 3 4
    a.token_ids.append(9)
    with pytest.raises(RowsOutOfSyncError, match="continues but has no row"):
        one_step(rows, (False, b, 0, 2, [0]))
    with pytest.raises(RowsOutOfSyncError, match="continues from token 4 but its row computed 5"):
        one_step(rows, (False, a, 4, 1, []))
    with pytest.raises(RowsOutOfSyncError, match="is new to the scheduler but has row"):
        one_step(rows, (True, a, 0, 6, [3, 4]))
    c = FakeRequest("c", list(range(1, 10)))
    with pytest.raises(RowsOutOfSyncError, match="computes up to token 9 but its row holds 9 tokens in 2 blocks"):
        one_step(rows, (True, c, 0, 9, [0, 1]))  # 9 tokens need 3 blocks of 4
    rows.free("c")
    with pytest.raises(RowsOutOfSyncError, match="computes up to token 7 but its row holds 6 tokens"):
        one_step(rows, (False, a, 5, 2, []))  # the row holds only one token past the computed ones
    step = one_step(rows, (False, a, 5, 1, []), (True, b, 0, 2, [0]))  # what agrees with the rows runs
    assert step.starts.tolist() == [5, 0] and step.seqs.sample.tolist() == [True, True]
    assert rows.block_tables[rows.row_of("a")].tolist() == [3, 4, 0]
    with pytest.raises(RowsOutOfSyncError, match="all 2 rows are held"):
        one_step(rows, (True, FakeRequest("d", [1]), 0, 1, [2]))
    one_step(rows, (True, FakeRequest("d", [1]), 0, 1, [2]), finished=["b"])  # b left first: its row is d's


def test_freed_rows_release_their_adapter_keys():
    sim, rows = run_steps(7, steps=40)
    for request in list(sim.running):
        sim.remove(request)
    for request_id in sim.freed:
        rows.free(request_id)
    assert rows.num_rows == 0 and not rows._loras._key_of and not rows._prompts._key_of
    assert rows._loras.slots({"a": 3}).tolist() == [-1] * (rows.max_num_seqs + 1)


def test_commit_refuses_a_token_count_that_does_not_match():
    rows = InputBatch(max_num_seqs=2, max_blocks_per_seq=2, block_size=4)
    request = FakeRequest("x", [1, 2, 3])
    step = one_step(rows, (True, request, 0, 3, [5]))
    with pytest.raises(ValueError, match="sampled token lists"):
        rows.commit(step, [])
    rows.commit(step, [[9]])
    assert rows.token_ids[rows.row_of("x"), :4].tolist() == [1, 2, 3, 9]
    assert np.array_equal(rows.block_tables[rows.row_of("x")], [5, 0])


def test_a_request_longer_than_its_table_is_refused():
    rows = InputBatch(max_num_seqs=1, max_blocks_per_seq=1, block_size=4)
    with pytest.raises(ValueError, match="more than its KV blocks"):
        one_step(rows, (True, FakeRequest("x", list(range(6))), 0, 4, [0, 1]))
    assert rows.num_rows == 0


def test_engine_rows_mirror_the_running_requests(engine_checkpoint, greedy_oracle):
    """Through LLMEngine: preemptions (a tight KV cache), chunked prefill, aborts and a reused id.
    After each update the rows hold exactly the running requests' tokens, counts and tables (no row of
    a request that left), and every finished request matches the greedy oracle."""
    from lora_runner import LLMEngine, SamplingParams
    from lora_runner.worker.kv_cache import kv_block_bytes
    from lora_runner.model import ModelConfig

    path, hf, _ = engine_checkpoint
    engine = LLMEngine(path, device="cpu", max_num_seqs=4, max_model_len=48, block_size=4, max_num_batched_tokens=8,
                       kv_cache_memory_bytes=12 * kv_block_bytes(ModelConfig.from_dir(path), 4, torch.float32))
    rows, update = engine.runner.input_batch, engine.runner.input_batch.update
    checked = []

    def checked_update(step, lora_slot_of, prompt_slot_of):
        result = update(step, lora_slot_of, prompt_slot_of)
        running = {r.request_id: r for r in engine.scheduler.running}
        held = {request_id for request_id in rows.request_ids if request_id is not None}
        assert held <= set(running), held - set(running)
        for chunk in step.scheduled:
            request, row = chunk.request, rows.row_of(chunk.request.request_id)
            count = int(rows.num_tokens[row])
            assert count == request.num_tokens and int(rows.num_computed[row]) == chunk.start
            assert rows.token_ids[row, :count].tolist() == request.token_ids
            table = engine.block_manager.table(request.request_id)
            assert rows.block_tables[row, :len(table)].tolist() == table
            assert not rows.block_tables[row, len(table):].any()
        checked.append(len(step.scheduled))
        return result

    engine.runner.input_batch.update = checked_update
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randint(4, 24))] for _ in range(7)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    done = {}

    def step():
        for out in engine.step():
            done[out.request_id] = out
            if out.request_id == "q1" and out.outputs[0].finish_reason == "abort":
                engine.add_request("q1", prompts[1], params)  # the id is free again: a new request

    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
        step()
        if i == 3:  # q1 is mid-flight
            engine.abort_request("q1")
    while engine.has_unfinished_requests():
        step()
    assert engine.scheduler.num_preemptions > 0 and sum(checked) > 20
    assert rows.num_rows > 0  # the last finished requests' rows: freed by the next step, which runs nothing
    assert engine.step() == [] and rows.num_rows == 0
    for i, prompt in enumerate(prompts):
        assert done[f"q{i}"].outputs[0].token_ids == greedy_oracle(hf, prompt, 8)[0], i
