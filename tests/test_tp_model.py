"""Tensor parallelism on CPU (gloo, 2 ranks): a rank's shard of the model and of its adapters.

Each family's tiny checkpoint (norms and biases randomized) runs the same mixed batch through a
ModelRunner at tensor_parallel_size=1 (in this process) and on both ranks of a 2-process gloo group
(tests/tp_support.RankPool): base rows, plain LoRA at ranks 4 and 8, DoRA, embed_tokens + lm_head
LoRA, a soft prompt and a soft prompt with a LoRA, a prefill then two decode steps. Every rank's
greedy tokens equal tp=1's and their logprobs agree within 1e-4. The adapters are read once, in
this process, at full size (DoRA's scales from the full base weights); each rank writes
``shard_lora_weights`` of that one copy into slots of ``shard_spec``'s local shapes.

Also: the collectives of a decode step are counted (2 all-reduces per layer, 1 for the embedding,
1 all-gather of the logits; LoRA of every kind adds none), a rank reads only its shard of the
checkpoint, the splits that cannot be made are ValueErrors raised before any weight is read, one
KV head is replicated on both ranks, and an odd vocabulary is padded.
"""

from __future__ import annotations

import os

import pytest
import torch

from adapters import LoRASlots, PromptSlots
from adapters.lora import load_lora
from adapters.prompt import load_prompt_adapter
from adapters.sharding import shard_lora_weights, shard_spec
from adapters.vocab_slots import VocabLoRASlots
from factories import build_tiny_model, save_lora, save_prompt_adapter, save_tiny_model
from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model import LlamaForCausalLM, load_model
from lora_runner.model import loader as loader_module
from lora_runner.model.checkpoint_base_weights import checkpoint_base_weights
from lora_runner.model.layers import lora_base_weights
from lora_runner.sampling_params import SamplingParams
from lora_runner.worker.batch_builder import SeqChunk
from lora_runner.worker.model_runner import ModelRunner
from test_model_families import PHI3_MODULES, save_family_model
from quant_support import save_ct_fp8, save_ct_w4a16
from test_quant_int4_formats import write_int4_checkpoint
from tp_support import RankPool

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's notes on tied / embedding layers

TOL = 1e-4
MAX_LORAS, MAX_RANK, BLOCK_SIZE, WIDTH, NUM_VIRTUAL = 4, 8, 4, 8, 3
FAMILIES = {  # name -> save_family_model kwargs (tests/factories.tiny_config: 2 layers, 4 heads, 2 KV heads)
    "llama-bias-oddvocab": dict(arch="llama", attention_bias=True, mlp_bias=True, vocab_size=255),
    "llama-1kv": dict(arch="llama", num_key_value_heads=1),  # one KV head, replicated on both ranks
    "mistral-window": dict(arch="mistral", sliding_window=6),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3", head_dim=32, attention_bias=True),
    "gemma2": dict(arch="gemma2", head_dim=32, query_pre_attn_scalar=24, sliding_window=5,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True),
    "phi3": dict(arch="phi3", sliding_window=7),
}
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_kwargs(arch: str) -> dict[str, dict]:
    """save_lora kwargs of the batch's adapters (Phi-3's modules are its fused ones)."""
    modules = PHI3_MODULES if arch == "phi3" else SPLIT
    return {
        "r4": dict(seed=11, r=4, lora_alpha=8, target_modules=modules),
        "r8": dict(seed=12, r=8, lora_alpha=16, use_rslora=True, target_modules=[modules[0], modules[-1]]),
        "dora": dict(seed=13, r=4, lora_alpha=8, use_dora=True, target_modules=(
            ["o_proj", "down_proj"] if arch == "phi3" else ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])),
        "vocab": dict(seed=14, r=4, lora_alpha=8, scale=0.2, target_modules=["embed_tokens", "lm_head", modules[0]]),
    }


@pytest.fixture(scope="module")
def pool():
    ranks = RankPool(2)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(checkpoint dir, full-size LoRAWeights by name, soft prompt, config) of one family."""
    root = tmp_path_factory.mktemp(request.param)
    kwargs = dict(FAMILIES[request.param])
    arch = kwargs.pop("arch")
    hf = save_family_model(root / "model", arch, seed=len(request.param), **kwargs)
    model, config, _ = load_model(str(root / "model"))
    spec = config.spec()
    loras = {}
    for name, lora_kwargs in adapter_kwargs(arch).items():
        save_lora(hf, root / name, **lora_kwargs)
        loras[name] = load_lora(name, str(root / name), spec, max_lora_rank=MAX_RANK,
                                base_weight=lora_base_weights(model))
    save_prompt_adapter(hf, root / "soft", num_virtual_tokens=NUM_VIRTUAL, seed=5)
    prompt = load_prompt_adapter("soft", str(root / "soft"), spec, max_prompt_adapter_tokens=NUM_VIRTUAL)
    return str(root / "model"), loras, prompt, config


def mixed_chunks(vocab_size: int) -> list[SeqChunk]:
    """One sequence per adapter kind: base, r4, r8, DoRA, embed/lm_head LoRA (slots 0-3), a soft prompt
    (prompt slot 0) alone and with r4; each on its own blocks."""
    gen = torch.Generator().manual_seed(vocab_size)
    kinds = [(-1, -1), (0, -1), (1, -1), (2, -1), (3, -1), (-1, 0), (0, 0)]  # (lora slot, prompt slot)
    chunks = []
    for i, (lora_slot, prompt_slot) in enumerate(kinds):
        prompt = torch.randint(3, vocab_size, (3 + i,), generator=gen).tolist()
        if vocab_size % 2:
            prompt[0] = vocab_size - 1  # the last row: on the rank whose share is padded
        virtual = NUM_VIRTUAL if prompt_slot >= 0 else 0
        tokens = [0] * virtual + prompt
        chunks.append(SeqChunk(token_ids=tokens, start=0, num_new_tokens=len(tokens),
                               block_table=list(range(1 + i * WIDTH, 1 + (i + 1) * WIDTH)), lora_slot=lora_slot,
                               prompt_adapter_slot=prompt_slot, num_virtual_tokens=virtual))
    return chunks


def make_runner(model, config, loras, prompt, tp: TensorParallel) -> ModelRunner:
    """A rank's runner with its shards of the adapters in slots 0-3 and the soft prompt in slot 0."""
    full = config.spec()
    local = shard_spec(full, tp.rank, tp.world_size)
    lora_slots = LoRASlots(local, MAX_LORAS, MAX_RANK)
    vocab_slots = VocabLoRASlots(local, MAX_LORAS, MAX_RANK)
    prompt_slots = PromptSlots(full, 1, NUM_VIRTUAL)  # replicated: the full hidden size
    for slot, name in enumerate(n for n in ("r4", "r8", "dora", "vocab") if n in loras):
        shard = shard_lora_weights(loras[name], full, tp.rank, tp.world_size)
        lora_slots.write(slot, shard)
        vocab_slots.write(slot, shard)
    if prompt is not None:
        prompt_slots.write(0, prompt)
    return ModelRunner(model, config, lora_slots, num_kv_blocks=1 + 8 * WIDTH, block_size=BLOCK_SIZE,
                       max_num_tokens=128, max_num_seqs=8, max_blocks_per_seq=WIDTH, max_loras=MAX_LORAS,
                       max_lora_rank=MAX_RANK, dtype=torch.float32, device=torch.device("cpu"),
                       prompt_slots=prompt_slots, vocab_slots=vocab_slots, tp=tp)


def run_mixed_batch(tp: TensorParallel, path: str, loras, prompt, quantization: str | None = None) -> dict:
    """Prefill the mixed batch, then decode twice (the second step on base rows only); per step the
    sampled tokens, their top-20 logprobs and the collectives it issued. Without adapters (loras
    empty, prompt None) every row is a base row."""
    torch.manual_seed(0)
    model, config, _ = load_model(path, tp=tp, quantization=quantization)
    runner = make_runner(model, config, loras, prompt, tp)
    chunks = mixed_chunks(config.vocab_size)
    if prompt is None:
        for chunk in chunks:
            chunk.lora_slot = -1
            chunk.prompt_adapter_slot, chunk.num_virtual_tokens = -1, 0
    steps = []
    for step in range(3):
        if step == 2:
            chunks = [c for c in chunks if c.lora_slot < 0 and c.prompt_adapter_slot < 0]
        params = [SamplingParams(temperature=0.0, logprobs=20)] * len(chunks)
        tp.counts.reset()
        out = runner.execute_chunks(chunks, params, [None] * len(chunks))
        steps.append(dict(tokens=out.token_ids, logprobs=out.logprobs, counts=dict(tp.counts.calls)))
        for chunk, token in zip(chunks, out.token_ids):
            chunk.token_ids = chunk.token_ids + [token]
            chunk.start, chunk.num_new_tokens = len(chunk.token_ids) - 1, 1
    return dict(steps=steps, num_layers=config.num_layers, kv_shape=tuple(runner.kv_cache.shape))


def assert_same_outputs(got: dict, want: dict, who: str) -> None:
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        assert g["tokens"] == w["tokens"], f"{who}, step {step}: tokens differ"
        for row, (g_lp, w_lp) in enumerate(zip(g["logprobs"], w["logprobs"])):
            assert g_lp.keys() == w_lp.keys(), f"{who}, step {step}, row {row}: other top tokens"
            worst = max(abs(g_lp[t] - w_lp[t]) for t in w_lp)
            assert worst <= TOL, f"{who}, step {step}, row {row}: logprobs differ by {worst:.2e}"


@pytest.fixture(scope="module")
def outputs(pool, family):
    """(tp=1's run of the mixed batch, each rank's run of it at tp=2)."""
    path, loras, prompt, _ = family
    return run_mixed_batch(SINGLE, path, loras, prompt), pool.run(run_mixed_batch, path, loras, prompt)


@pytest.mark.slow  # the first test on the pool starts its 2 processes (~10-30 s on 2 busy cores)
def test_mixed_batch_matches_one_rank(family, outputs):
    want, ranks = outputs
    for rank, got in enumerate(ranks):
        assert_same_outputs(got, want, f"rank {rank}")
    assert len(set(want["steps"][0]["tokens"])) > 1  # rows differ: the adapters are not all no-ops
    kv_heads = max(1, family[3].num_kv_heads // 2)  # a KV head of its own, or the one replicated
    assert [r["kv_shape"][4] for r in ranks] == [kv_heads, kv_heads]


@pytest.mark.slow
def test_decode_collectives_counted_and_lora_adds_none(outputs):
    """Per step: 2 all-reduces per layer + 1 (embedding), 1 all-gather (logits); the decode step with
    every adapter kind (lm_head LoRA included) issues exactly what the base-only step does."""
    for got in outputs[1]:
        expected = {"all_reduce": 2 * got["num_layers"] + 1, "all_gather": 1}
        prefill, with_adapters, base_only = (step["counts"] for step in got["steps"])
        assert with_adapters == expected and base_only == expected and prefill == expected


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["fp8-online", "fp8-compressed-tensors"])
def test_fp8_shards_match_one_rank(pool, tmp_path, quant):
    """FP8 linears split like the float ones; online FP8 takes each row-parallel row's scale over
    every rank's columns (an all-reduce of the maxima at load), so the shards quantize as one rank."""
    if quant == "fp8-online":
        save_tiny_model(tmp_path, "llama", tokenizer=False, seed=3)
        quantization = "fp8"
    else:
        save_ct_fp8(tmp_path, "channel", seed=3)
        quantization = None
    want = run_mixed_batch(SINGLE, str(tmp_path), {}, None, quantization)
    for rank, got in enumerate(pool.run(run_mixed_batch, str(tmp_path), {}, None, quantization)):
        assert_same_outputs(got, want, f"rank {rank}")


def save_int4(path, quant: str, **overrides) -> None:
    """A tiny Llama as a 4-bit checkpoint (group size 32) of format ``quant``."""
    if quant == "compressed-tensors":
        save_ct_w4a16(path, group_size=32, seed=4, **overrides)
    else:
        model = build_tiny_model("llama", seed=4, **overrides)
        write_int4_checkpoint(model, path, quant, group_size=32, generator=torch.Generator().manual_seed(4))


@pytest.mark.slow
@pytest.mark.parametrize("quant", ["gptq", "awq", "compressed-tensors"])
def test_int4_shards_match_one_rank(pool, tmp_path, quant):
    """Each 4-bit layout is read in whole packed words and groups: the rank's o / down keep 32 and 64
    input columns (two and one groups of 32), its qkv / gate_up rows are whole words."""
    save_int4(tmp_path, quant, intermediate_size=128, attention_bias=True, mlp_bias=True)  # biases: split or not
    want = run_mixed_batch(SINGLE, str(tmp_path), {}, None)
    for rank, got in enumerate(pool.run(run_mixed_batch, str(tmp_path), {}, None)):
        assert_same_outputs(got, want, f"rank {rank}")


@pytest.mark.parametrize("quant, overrides, act_order, message", [
    ("gptq", dict(intermediate_size=96), False, r"group_size 32 does not divide the input width 48 of the down"),
    ("compressed-tensors", dict(intermediate_size=96), False, r"input width 48 of the down"),
    ("gptq", dict(intermediate_size=128), True, r"act-order GPTQ \(desc_act=True\) cannot be split"),
])
def test_int4_splits_that_break_groups_are_refused(tmp_path, monkeypatch, quant, overrides, act_order, message):
    if act_order:
        model = build_tiny_model("llama", seed=4, **overrides)
        write_int4_checkpoint(model, tmp_path, quant, group_size=32, act_order=True,
                              generator=torch.Generator().manual_seed(4))
    else:
        save_int4(tmp_path, quant, **overrides)

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(loader_module, "safe_open", no_reading)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), tp=TensorParallel(rank=1, world_size=2))


def read_bytes_of_rank(tp: TensorParallel, path: str) -> tuple[int, int]:
    """(bytes this rank read from the checkpoint, bytes of every tensor in it), via a counting safe_open."""
    real = loader_module.safe_open
    read, total = [0], [0]

    class CountingHandle:
        def __init__(self, handle):
            self.handle = handle

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            tensor = self.handle.get_tensor(name)
            read[0] += tensor.numel() * tensor.element_size()
            return tensor

        def get_slice(self, name):
            view = self.handle.get_slice(name)
            return CountingSlice(view)

    class CountingSlice:
        def __init__(self, view):
            self.view = view

        def get_shape(self):
            return self.view.get_shape()

        def __getitem__(self, index):
            tensor = self.view[index]
            read[0] += tensor.numel() * tensor.element_size()
            return tensor

    class CountingOpen:
        def __init__(self, *args, **kwargs):
            self.opened = real(*args, **kwargs)

        def __enter__(self):
            handle = self.opened.__enter__()
            for name in handle.keys():
                tensor = handle.get_slice(name)
                total[0] += int(torch.Size(tensor.get_shape()).numel()) * 4  # fp32 checkpoints
            return CountingHandle(handle)

        def __exit__(self, *exc):
            return self.opened.__exit__(*exc)

    loader_module.safe_open = CountingOpen
    try:
        load_model(path, tp=tp)
    finally:
        loader_module.safe_open = real
    return read[0], total[0]


@pytest.mark.slow
def test_a_rank_reads_only_its_shard(pool, tmp_path):
    """Every weight but the norms is split: a rank reads just over half the checkpoint, never all of it."""
    save_tiny_model(tmp_path, "llama", tokenizer=False)
    results = pool.run(read_bytes_of_rank, str(tmp_path))
    for read, total in results:
        assert 0.45 * total < read < 0.55 * total, (read, total)


@pytest.mark.parametrize("world_size, overrides, message", [
    (3, {}, r"num_attention_heads \(4\) is not divisible by tensor_parallel_size \(3\)"),
    (2, dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3),
     r"num_key_value_heads \(3\) is not divisible by tensor_parallel_size \(2\)"),
    (4, dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=3),
     r"tensor_parallel_size \(4\) is not a multiple of num_key_value_heads \(3\)"),
    (4, dict(intermediate_size=90), r"intermediate_size \(90\) is not divisible by tensor_parallel_size \(4\)"),
])
def test_impossible_splits_are_refused_before_any_weight_is_read(tmp_path, monkeypatch, world_size, overrides,
                                                                 message):
    save_tiny_model(tmp_path, "llama", tokenizer=False, **overrides)

    def no_reading(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(loader_module, "safe_open", no_reading)
    with pytest.raises(ValueError, match=message):
        load_model(str(tmp_path), tp=TensorParallel(rank=world_size - 1, world_size=world_size))


def test_shard_spec_and_lora_shards(family):
    """The rank's sizes, and its adapter shards: views of the one full copy; a column-parallel
    module's B rows (and DoRA scale) split, a row-parallel module's A columns split with B whole."""
    _, loras, _, config = family
    full = config.spec()
    for rank in range(2):
        local = shard_spec(full, rank, 2)
        assert (local.num_heads, local.intermediate_size, local.hidden_size) == (
            full.num_heads // 2, full.intermediate_size // 2, full.hidden_size)
        assert local.vocab_size == -(-full.vocab_size // 2)
        dora = shard_lora_weights(loras["dora"], full, rank, 2)
        for (layer, packed), pairs in dora.modules.items():
            for pair, whole in zip(pairs, loras["dora"].modules[layer, packed]):
                if pair is None:
                    continue
                assert pair.a.untyped_storage().data_ptr() == whole.a.untyped_storage().data_ptr()
                if packed in ("o", "down"):
                    assert pair.b is whole.b and pair.column_scale is whole.column_scale
                    assert pair.a.shape[1] == whole.a.shape[1] // 2
                else:
                    assert pair.a is whole.a and pair.b.shape[0] == pair.column_scale.shape[0] > 0
    with pytest.raises(ValueError, match="rank must lie"):
        shard_spec(full, 2, 2)


def test_dora_scales_from_the_checkpoint_equal_the_models(family):
    """The engine validates a DoRA adapter once, holding no model: W read from the checkpoint gives the
    column scales the served model's own weights give (every family; FP8 below, for one)."""
    check_checkpoint_dora_scales(family[0], None)


def test_dora_scales_from_an_fp8_checkpoint_equal_the_models(tmp_path):
    """The same with the weights quantized (online FP8) as the served model's are."""
    hf = save_family_model(tmp_path / "model", "llama", seed=3)
    save_lora(hf, tmp_path / "dora", **adapter_kwargs("llama")["dora"])
    check_checkpoint_dora_scales(str(tmp_path / "model"), "fp8")


def check_checkpoint_dora_scales(path: str, quantization: str | None) -> None:
    """checkpoint_base_weights vs lora_base_weights(model) for the DoRA adapter saved beside `path`."""
    model, config, _ = load_model(path, quantization=quantization)
    lora_dir = os.path.join(os.path.dirname(path), "dora")
    kwargs = dict(max_lora_rank=MAX_RANK)
    want = load_lora("dora", lora_dir, config.spec(), base_weight=lora_base_weights(model), **kwargs)
    got = load_lora("dora", lora_dir, config.spec(), base_weight=checkpoint_base_weights(path, config), **kwargs)
    scales = [(g.column_scale, w.column_scale) for key, pairs in want.modules.items()
              for g, w in zip(got.modules[key], pairs) if w is not None]
    assert scales and all(torch.equal(g, w) for g, w in scales)


def test_a_shard_refuses_to_give_dora_its_partial_weights(family):
    """A rank's o / down hold half of each row: DoRA's norms from them would be wrong, silently."""
    path, _, _, config = family
    shard = LlamaForCausalLM(config, tp=TensorParallel(rank=0, world_size=2))  # built only, never run
    with pytest.raises(ValueError, match="checkpoint_base_weights"):
        lora_base_weights(shard)
