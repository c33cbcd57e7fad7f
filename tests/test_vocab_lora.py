"""LoRA on embed_tokens and lm_head against PEFT (adapters written by PEFT, oracle: PEFT forward logits).

Mixed batches of embedding-only, lm_head-only and both-plus-projections adapters with plain LoRA and
no-adapter rows, on tied and untied embeddings; a soft prompt together with an embedding LoRA;
decode graphs (emulated on CPU); more adapters than slots (a slot that held embed/lm_head factors
reused by a plain adapter gives plain results). Also: parsing and refusals, the slot layout, and the
gather shrink kernel (Triton interpreter, fp32 and fp16) against a float64 reference.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import punica_kernels
from adapters import AdapterTooLargeError, InvalidAdapterError, LoRARequest, PromptAdapterRequest
from adapters.errors import UnsupportedAdapterError
from adapters.lora import load_lora
from adapters.vocab_slots import VocabLoRASlots
from factories import build_tiny_model, edit_adapter_config, model_spec, save_lora, save_prompt_adapter, save_tiny_model
from lora_runner import SamplingParams
from lora_runner.worker.cuda_graphs import RerunGraph

from engine_support import assert_exact, make_engine, run_to_completion
from test_prompt_adapters import SoftPromptOnLoRA

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's tied-weights / save_embedding_layers notes

VOCAB = 256
ADAPTERS = {  # name -> save_lora kwargs
    "embed": dict(seed=21, r=4, lora_alpha=8, target_modules=["embed_tokens"]),
    "head": dict(seed=22, r=8, lora_alpha=16, use_rslora=True, target_modules=["lm_head"]),
    "both": dict(seed=23, r=8, lora_alpha=16, rank_pattern={"embed_tokens": 16}, alpha_pattern={"lm_head": 4},
                 target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj", "down_proj"]),
    "plain": dict(seed=24, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj"]),
}
# 8 rows, 4 slots; a read of an unwritten vocab slot row shows as NaN
ENGINE = dict(max_num_seqs=8, max_loras=4, poison=("vocab_slots",))


@pytest.fixture(scope="module", params=["untied", "tied"])
def env(request, tmp_path_factory):
    """A tiny Llama (tied or untied embeddings) and PEFT adapters: name -> (dir, PeftModel)."""
    root = tmp_path_factory.mktemp(f"vocab-{request.param}")
    hf = save_tiny_model(root / "model", "llama", seed=0, tie_word_embeddings=request.param == "tied")
    adapters = {name: (str(root / name), save_lora(hf, root / name, scale=0.2, **kwargs))
                for name, kwargs in ADAPTERS.items()}
    return SimpleNamespace(path=str(root / "model"), hf=hf, adapters=adapters, root=root, tied=request.param)


def oracle_of(env, name):
    return env.hf if name is None else env.adapters[name][1]


def lora_of(env, name):
    return None if name is None else LoRARequest(name, env.adapters[name][0])


def capture_logits(engine) -> list[torch.Tensor]:
    """Every step's logits [S, V] as compute_logits returns them."""
    captured, model = [], engine.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda *args: captured.append(compute_logits(*args)) or captured[-1]
    return captured


def random_prompts(n, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(n)]


MIXED = ["embed", "head", None, "both", "plain", "both", "embed"]


def test_mixed_batch_first_step_logits_and_greedy_match_peft(env, greedy_oracle):
    engine = make_engine(env.path, **(ENGINE | dict(max_num_batched_tokens=128)))
    for name in ADAPTERS:  # loaded now: every request is admitted in the first step
        engine.add_lora(lora_of(env, name))
    prompts = random_prompts(len(MIXED), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    for i, (name, prompt) in enumerate(zip(MIXED, prompts)):
        engine.add_request(f"m{i}", prompt, params, lora_request=lora_of(env, name))
    captured = capture_logits(engine)
    first = engine.step()  # prefills every prompt: one row per request, in the outputs' order
    assert captured[0].shape[0] == len(first) == len(MIXED)
    done = run_to_completion(engine)
    with torch.inference_mode():
        for row, output in enumerate(first):
            i = int(output.request_id[1:])
            name, prompt = MIXED[i], prompts[i]
            want = oracle_of(env, name)(torch.tensor([prompt])).logits[0, -1]  # [V]
            assert (captured[0][row] - want).abs().max() <= 1e-4, (name, row)
            if name is not None:  # each adapter's delta is far above the tolerance
                assert (want - env.hf(torch.tensor([prompt])).logits[0, -1]).abs().max() > 0.1, name
    for i, (name, prompt) in enumerate(zip(MIXED, prompts)):
        assert_exact(done[f"m{i}"], oracle_of(env, name), prompt, greedy_oracle, 5)


def test_more_adapters_than_slots_evicts_and_reuses_slots_cleanly(env, greedy_oracle):
    """Two slots: 'both' and 'head' fill them, then 'plain' and 'embed' evict them; a slot reused by an
    adapter without embed/lm_head LoRA must give plain results, and eviction zeroes the vocab slots.
    Untied: a CPU cache of 4 (slot evictions); tied: of 2 (dropping a version frees its slot)."""
    engine = make_engine(env.path, **(ENGINE | dict(max_loras=2, max_cpu_loras=4 if env.tied == "untied" else 2)))
    vocab_slots = engine.adapters.manager.vocab_slots
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    prompts = random_prompts(4, seed=2)
    waves = [["both", "head"], ["plain", "embed"], ["plain", None]]
    for wave, names in enumerate(waves):
        requests = [(f"w{wave}-{i}", prompts[(wave + i) % 4], params, lora_of(env, n), None)
                    for i, n in enumerate(names)]
        done = run_to_completion(engine, requests)
        for (request_id, prompt, _, _, _), name in zip(requests, names):
            assert_exact(done[request_id], oracle_of(env, name), prompt, greedy_oracle, 4)
    stats = engine.adapters.manager.stats
    assert stats.lora_loads == 4 and stats.lora_evictions + stats.lora_cpu_evictions >= 2
    assert not vocab_slots.lm_head_in_use() and vocab_slots.lm_head_b.abs().sum() == 0  # 'both', 'head' evicted
    engine.remove_lora("embed")  # removal clears its slot too
    assert int((vocab_slots.embedding_ranks > 0).sum()) == 0
    assert all(torch.count_nonzero(t) == 0 for t in vocab_slots._tensors())


def test_soft_prompt_with_embedding_lora_matches_peft(env, greedy_oracle):
    """Virtual tokens are the soft prompt exactly (PEFT never embeds them); real tokens get the delta."""
    if env.tied == "tied":
        pytest.skip("the untied model covers the soft prompt; the embedding path is the same")
    pa_dir = env.root / "pa3"
    save_prompt_adapter(env.hf, pa_dir, num_virtual_tokens=3, seed=5)
    soft = load_file(f"{pa_dir}/adapter_model.safetensors")["prompt_embeddings"]
    oracles = {name: SoftPromptOnLoRA(env.hf, env.adapters[name][0], soft) for name in ("both", "embed")}
    engine = make_engine(env.path, **(ENGINE | dict(max_prompt_adapters=1, max_prompt_adapter_tokens=4)))
    prompts = random_prompts(3, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=1)
    pa = PromptAdapterRequest("pa3", str(pa_dir))
    names = ["both", "embed", None]
    requests = [(f"s{i}", p, params, lora_of(env, n), pa if n else None)
                for i, (n, p) in enumerate(zip(names, prompts))]
    done = run_to_completion(engine, requests)
    for (request_id, prompt, _, _, _), name in zip(requests, names):
        assert_exact(done[request_id], oracles[name] if name else env.hf, prompt, greedy_oracle, 4)


def test_decode_graphs_apply_embedding_lora_captured_with_a_plain_warmup_adapter(env, greedy_oracle):
    """Graphs are captured with a warm-up adapter that has no embedding LoRA; replays must still add
    each decode token's embedding delta (CPU stand-in graphs rerun what was captured)."""
    if env.tied == "tied":
        pytest.skip("one embedding layout suffices for the graph path")
    engine = make_engine(env.path, **ENGINE)
    engine.runner.capture_decode_graphs(engine.adapters.manager.loras, 16, make_graph=RerunGraph, progress=False)
    prompts = random_prompts(3, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = ["embed", "both", None]
    requests = [(f"g{i}", p, params, lora_of(env, n)) for i, (n, p) in enumerate(zip(names, prompts))]
    done = run_to_completion(engine, requests)
    for i, (name, prompt) in enumerate(zip(names, prompts)):
        assert_exact(done[f"g{i}"], oracle_of(env, name), prompt, greedy_oracle, 5)


# ---------------------------------------------------------------- parsing, refusals, slot layout

def test_parsed_factors_keep_scaling_apart_and_slots_lay_them_out(env):
    spec = dataclasses.replace(model_spec(env.hf), vocab_size=VOCAB)
    weights = load_lora("both", env.adapters["both"][0], spec, max_lora_rank=16)
    tensors = load_file(f"{env.adapters['both'][0]}/adapter_model.safetensors")
    embed_a = tensors["base_model.model.model.embed_tokens.lora_embedding_A"]  # [16, V]
    embed_b = tensors["base_model.model.model.embed_tokens.lora_embedding_B"]  # [hidden, 16]
    head_a, head_b = (tensors[f"base_model.model.lm_head.lora_{ab}.weight"] for ab in "AB")  # [8, hidden], [V, 8]
    assert weights.rank == 16 and set(weights.vocab) == {"embed_tokens", "lm_head"}
    assert torch.equal(weights.vocab["embed_tokens"].a, embed_a)
    assert torch.equal(weights.vocab["embed_tokens"].b, embed_b) and torch.equal(weights.vocab["lm_head"].b, head_b)
    assert weights.vocab["embed_tokens"].scaling == 16 / 16  # alpha 16 / r 16
    assert weights.vocab["lm_head"].scaling == 4 / 8  # alpha_pattern 4 / r 8
    slots = VocabLoRASlots(spec, 3, 16)
    for tensor in slots._tensors():
        tensor.fill_(float("nan"))
    slots.write(1, weights)
    assert torch.equal(slots.embedding_a[1, :, :16], embed_a.T) and torch.equal(slots.lm_head_a[1, 0, :8], head_a)
    assert torch.equal(slots.lm_head_b[1, :, :8], weights.vocab["lm_head"].b)
    assert slots.lm_head_b[1, :, 8:].abs().sum() == 0 and slots.embedding_a[0].isnan().all()  # padded / untouched
    assert slots.embedding_ranks.tolist() == [0, 16, 0] and slots.lm_head_ranks.tolist() == [0, 8, 0]
    assert slots.lm_head_scales[:, 0].tolist() == [1.0, 0.5, 1.0] and slots.embedding_scales[1, 0] == 1.0
    slots.clear(1)
    assert slots.lm_head_ranks.tolist() == [0, 0, 0] and not slots.lm_head_in_use()
    assert slots.lm_head_scales[:, 0].tolist() == [1.0, 1.0, 1.0]
    assert all(torch.count_nonzero(t[1]) == 0 for t in slots._tensors())


@pytest.fixture(scope="module")
def small_base():
    return build_tiny_model("llama", seed=0)


def _resized_lora(path, target):
    save_lora(build_tiny_model("llama", seed=0, vocab_size=VOCAB + 16), path, r=4, target_modules=[target])


REFUSED = {  # case -> (writer(path, base), error, message fragment)
    "modules_to_save": (lambda p, b: save_lora(b, p, r=4, modules_to_save=["lm_head"]),
                        UnsupportedAdapterError, "modules_to_save"),
    "trainable_tokens": (lambda p, b: save_lora(b, p, r=4, target_modules=["q_proj"],
                                                trainable_token_indices={"embed_tokens": [3, 4]}),
                         UnsupportedAdapterError, "trainable tokens"),
    "resized_embedding": (lambda p, b: _resized_lora(p, "embed_tokens"), InvalidAdapterError, "resized vocabulary"),
    "resized_lm_head": (lambda p, b: _resized_lora(p, "lm_head"), InvalidAdapterError, "resized vocabulary"),
    "tied_loras": (lambda p, b: (save_lora(b, p, r=4, target_modules=["embed_tokens"]),
                                 edit_adapter_config(p, ensure_weight_tying=True)),
                   UnsupportedAdapterError, "ensure_weight_tying"),
    "embedding_rank": (lambda p, b: save_lora(b, p, r=4, target_modules=["embed_tokens", "q_proj"],
                                              rank_pattern={"embed_tokens": 32}), AdapterTooLargeError, "rank 32"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unservable_vocab_adapters_are_refused_clearly(small_base, tmp_path, case):
    write, error, fragment = REFUSED[case]
    write(tmp_path, small_base)
    spec = dataclasses.replace(model_spec(small_base), vocab_size=VOCAB)
    with pytest.raises(error, match=fragment) as info:
        load_lora(f"tenant-{case}", str(tmp_path), spec, max_lora_rank=16)
    assert f"tenant-{case}" in str(info.value)


def test_vocab_lora_needs_a_known_vocabulary(small_base, tmp_path):
    save_lora(small_base, tmp_path, r=4, target_modules=["lm_head"])
    with pytest.raises(UnsupportedAdapterError, match="vocabulary size"):
        load_lora("t", str(tmp_path), model_spec(small_base), max_lora_rank=16)  # a spec without vocab_size


# ---------------------------------------------------------------- the gather shrink kernel

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rank", [8, 16, 64])
def test_embedding_shrink_triton_matches_float64_reference(dtype, rank):
    gen = torch.Generator().manual_seed(rank)
    max_loras, vocab, hidden, num_tokens = 4, 300, 48, 45
    meta = punica_kernels.LoRAMeta(64, max_loras, "cpu")
    slots = torch.randint(-1, max_loras, (num_tokens,), generator=gen)
    ids = torch.randint(0, vocab, (num_tokens,), generator=gen)
    ids[3] = vocab  # out of the vocabulary: a zero row, never an out-of-bounds read
    punica_kernels.load_table(meta, slots)
    lora_a = torch.randn(max_loras, vocab, rank, generator=gen).to(dtype)  # [L, V, R]
    lora_b = torch.randn(max_loras, hidden, rank, generator=gen).to(dtype)  # [L, hidden, R]
    out = torch.full((num_tokens, 1, rank), float("nan"))
    punica_kernels.embedding_shrink(ids, lora_a, meta, out, backend="triton")
    want = punica_kernels.embedding_shrink(ids, lora_a.double(), meta)  # torch path, float64
    lora = slots >= 0
    assert torch.equal(out[lora].double(), want[lora])  # a gather: exact
    assert out[~lora].isnan().all()  # rows of no-adapter tokens are not written
    if slots[3] >= 0:
        assert out[3].abs().sum() == 0
    # the whole delta (gather + expand, the slot's scaling on the fp32 intermediate) against
    # scaling * B @ A[:, t] in float64
    scales = torch.rand(max_loras, 1, generator=gen) + 0.25  # [L, 1] float32
    hidden_in = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    got = hidden_in.clone()
    punica_kernels.lora_expand(got, out, lora_b, meta, (hidden,), slice_scales=scales, backend="triton")
    expected = hidden_in.double().clone()
    for t in range(num_tokens):
        if slots[t] >= 0 and ids[t] < vocab:
            expected[t] += scales[slots[t], 0].double() * (lora_b[slots[t]].double() @ lora_a[slots[t], ids[t]].double())
    tol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16: one rounding of the output (|y| ~ 10)
    assert (got.double() - expected).abs().max() <= tol * max(1.0, expected.abs().max().item() / 10)
    assert torch.equal(got[~lora], hidden_in[~lora])  # bit-identical


@pytest.mark.gpu
def test_embedding_lora_on_cuda_does_not_sync_and_replays_in_a_graph():
    device = torch.device("cuda")
    max_loras, vocab, hidden, rank, num_tokens = 4, 1000, 256, 16, 64
    meta = punica_kernels.LoRAMeta(num_tokens, max_loras, device, max_rank=rank, max_slices=1)
    lora_a = torch.randn(max_loras, vocab, rank, device=device, dtype=torch.float16)
    lora_b = torch.randn(max_loras, hidden, rank, device=device, dtype=torch.float16) * 0.1
    ids = torch.randint(0, vocab, (num_tokens,), device=device)
    slots = torch.arange(num_tokens, device=device) % (max_loras + 1) - 1
    inter = torch.empty(num_tokens, 1, rank, device=device)
    base = torch.randn(num_tokens, hidden, device=device, dtype=torch.float16)
    y = base.clone()

    def delta():
        punica_kernels.embedding_shrink(ids, lora_a, meta, inter)
        punica_kernels.lora_expand(y, inter, lora_b, meta, (hidden,))

    punica_kernels.load_table(meta, slots, check=False)
    delta()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y.copy_(base)
        delta()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = y.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        delta()
    y.copy_(base)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)
    expected = base.double().clone()
    for t in range(num_tokens):
        if slots[t] >= 0:
            expected[t] += lora_b[slots[t]].double() @ lora_a[slots[t], ids[t]].double()
    assert (y.double() - expected).abs().max() <= 2e-2


@pytest.mark.gpu
def test_cuda_engine_with_decode_graphs_matches_peft(env, greedy_oracle):
    """The Triton path end to end: graphs captured at start-up (warm-up adapter without vocab LoRA),
    then decode steps of embedding / lm_head / plain adapters replayed."""
    if env.tied == "tied":
        pytest.skip("one embedding layout suffices on the GPU")
    engine = make_engine(env.path, **(ENGINE | dict(poison=(), device="cuda", dtype="float32",
                                                    gpu_memory_utilization=0.5)))
    assert engine.runner.decode_graphs is not None
    prompts = random_prompts(len(MIXED), seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=1)
    requests = [(f"c{i}", p, params, lora_of(env, n)) for i, (n, p) in enumerate(zip(MIXED, prompts))]
    done = run_to_completion(engine, requests)
    for i, (name, prompt) in enumerate(zip(MIXED, prompts)):
        assert_exact(done[f"c{i}"], oracle_of(env, name), prompt, greedy_oracle, 6)
