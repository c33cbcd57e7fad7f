"""Mixture-of-experts models in the decode graphs (lora_runner.worker.cuda_graphs): their routed experts
run the fused Triton kernels (lora_runner.model.moe_fused), which read no device data on the host and
whose sizes depend on the padded batch alone, so one graph replays for any routing and adapter mix.

On the CPU the fused path is forced (moe_fused.use_fused) and runs under the Triton interpreter, with
the CPU GEMM's weight packing off (for the dense layers; routed experts stay dense anyway); graphs are emulated
(RerunGraph):
* every captured decode graph's forward (base-only, plain LoRA and full LoRA keys) runs no aten op that
  syncs with the host (the profiler's nested ops, as tests/test_gpu_readiness), and runs the fused
  kernels in every MoE layer, the expert LoRA ops only in graphs with LoRA;
* the graphed engine (fused experts) gives the eager engine's (torch path) greedy tokens and logprobs
  for a mixed batch: base rows, expert adapters of two ranks, an attention-only adapter, over fewer
  slots than adapters (slots re-written after capture).
On a GPU (marked gpu): one MoE block captured in a real CUDA graph replays bit-identically to its eager
forward over new routing, token slots and slot contents (adapters loaded, replaced, removed after the
capture); a CUDA engine captures MoE decode graphs at start-up and matches the eager engine.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import punica_kernels
from adapters import LoRARequest
from adapters.lora import LoRAWeights, dummy_lora
from adapters.slots import LoRASlots
from engine_support import run_to_completion
from factories import save_lora
from lora_runner import LLMEngine, SamplingParams
from lora_runner.model import cpu_gemm, load_model, moe_fused
from lora_runner.model.forward_context import LoRAContext
from lora_runner.model.moe import SparseMoeBlock
from lora_runner.worker.cuda_graphs import RerunGraph
from test_cuda_graphs_engine import check_same
from test_gpu_readiness import host_sync_ops
from test_moe import save_moe
from test_moe_lora import ADAPTERS, write_adapter

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ENGINE = dict(dtype="float32", max_num_seqs=4, max_model_len=40, max_loras=2, max_lora_rank=8, max_cpu_loras=8,
              block_size=4, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """(model dir, {adapter name: dir}) of a tiny Qwen3-MoE: ADAPTERS (every expert + q/v, two experts,
    the router) and PEFT's attention-only LoRA."""
    root = tmp_path_factory.mktemp("moe_graphs")
    hf = save_moe(root / "model", "qwen3_moe", seed=11)
    from lora_runner.model import ModelConfig

    spec = ModelConfig.from_dir(str(root / "model")).spec()
    dirs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        assert write_adapter(root / name, spec, targets, r, alpha, seed=50 + i), name
        dirs[name] = str(root / name)
    save_lora(hf, root / "attention-only", seed=51, r=4, target_modules=("q_proj", "o_proj"))
    dirs["attention-only"] = str(root / "attention-only")
    return str(root / "model"), dirs


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The fused MoE kernels on CPU tensors (Triton interpreter), expert weights left unpacked for them."""
    monkeypatch.setattr(cpu_gemm, "packable", lambda weight: False)
    monkeypatch.setattr(moe_fused, "use_fused", lambda block, hidden: moe_fused.fused_supported(block))


def mixed_requests(dirs: dict[str, str], seed: int = 0) -> list[tuple]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
    names = [None, "all-experts", "attention-only", "two-experts", None, "router", "all-experts"]
    return [(f"g{i}", [rng.randrange(3, 250) for _ in range(rng.randint(3, 14))], params,
             None if name is None else LoRARequest(name, dirs[name])) for i, name in enumerate(names)]


def graphed_engine(model_dir: str, **kwargs) -> LLMEngine:
    engine = LLMEngine(model_dir, device="cpu", **kwargs)
    engine.runner.capture_decode_graphs(engine.adapters.manager.loras, kwargs["max_lora_rank"], make_graph=RerunGraph,
                                        progress=False)
    return engine


@torch.inference_mode()
def test_fused_moe_decode_graphs_have_no_host_sync(moe_checkpoint, fused_on_cpu, monkeypatch):
    from punica_kernels import moe_triton

    model_dir, dirs = moe_checkpoint
    engine = graphed_engine(model_dir, **ENGINE)
    engine.adapters.manager.loras.activate([engine.add_lora(LoRARequest("all-experts", dirs["all-experts"]))])
    # the dense LoRA kernels are Triton on CUDA (their no-sync tests are elsewhere); on CPU their torch path syncs
    monkeypatch.setattr(punica_kernels, "add_lora", lambda y, *args, **kwargs: y)
    monkeypatch.setattr(punica_kernels, "embedding_shrink", lambda input_ids, lora_a, meta, out: out)
    monkeypatch.setattr(punica_kernels, "lora_expand", lambda y, *args, **kwargs: y)
    calls = {"fused": 0, "shrink": 0}
    fused, shrink = moe_fused.fused_routed_experts, moe_triton.moe_lora_shrink
    monkeypatch.setattr(moe_fused, "fused_routed_experts",
                        lambda *args: calls.__setitem__("fused", calls["fused"] + 1) or fused(*args))
    monkeypatch.setattr(moe_triton, "moe_lora_shrink",
                        lambda *args: calls.__setitem__("shrink", calls["shrink"] + 1) or shrink(*args))
    moe_layers = sum(isinstance(layer.mlp, SparseMoeBlock) for layer in engine.model.layers)
    graphs = engine.runner.decode_graphs
    assert moe_layers and len(graphs) == len(graphs.plan.keys())
    for key, captured in graphs._graphs.items():
        engine.runner.forward_contexts.prepare_lora(captured.batch)
        calls.update(fused=0, shrink=0)
        assert host_sync_ops(captured.graph.fn) == [], key
        assert calls == {"fused": moe_layers, "shrink": 2 * moe_layers if key.has_lora else 0}, key


def test_emulated_graphs_of_a_moe_engine_match_the_eager_torch_loop(moe_checkpoint, monkeypatch):
    model_dir, dirs = moe_checkpoint
    requests = mixed_requests(dirs)
    eager = LLMEngine(model_dir, device="cpu", **ENGINE)  # the torch loop over the experts
    want = run_to_completion(eager, requests, per_step=3)
    monkeypatch.setattr(cpu_gemm, "packable", lambda weight: False)
    monkeypatch.setattr(moe_fused, "use_fused", lambda block, hidden: moe_fused.fused_supported(block))
    calls, fused = [], moe_fused.fused_routed_experts
    monkeypatch.setattr(moe_fused, "fused_routed_experts", lambda *args: calls.append(1) or fused(*args))
    graphed = graphed_engine(model_dir, **ENGINE)
    assert calls and graphed.list_loras() == []  # captured through the fused path; warmup adapter removed
    check_same(want, run_to_completion(graphed, requests, per_step=3))
    assert graphed.runner.decode_graphs.num_replays >= 5
    assert graphed.adapters.manager.stats.lora_evictions > 0  # 4 adapters over 2 slots: written after capture


# ---------------------------------------------------------------- real CUDA graphs (a lent GPU)

def _attention_only(spec, rank: int, seed: int) -> LoRAWeights:
    weights = dummy_lora("attention", spec, rank, scale=0.2, seed=seed)
    return LoRAWeights("attention", rank, {key: pairs for key, pairs in weights.modules.items()
                                           if key[1] in ("qkv", "o")})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_moe_block_replays_in_a_cuda_graph_for_any_routing_and_adapter_mix(dtype, tmp_path):
    """Qwen2-MoE's block (router LoRA, routed experts, shared expert) captured once with slots 0 and 1
    filled; each replay, with new hidden states, token slots and slot contents, equals the eager forward."""
    save_moe(tmp_path / "model", "qwen2_moe", seed=12)
    model, config, _ = load_model(str(tmp_path / "model"), dtype=dtype, device="cuda")
    spec, num_tokens = config.spec(), 24
    block = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, SparseMoeBlock))
    slots = LoRASlots(spec, 3, 16, "cuda", dtype)
    slots.write(0, _attention_only(spec, 8, seed=1))
    slots.write(1, dummy_lora("r16", spec, 16, scale=0.2, seed=2))
    meta = punica_kernels.LoRAMeta(num_tokens, 3, "cuda", max_rank=16, max_slices=3)
    loader = punica_kernels.TableLoader(meta)
    ctx = SimpleNamespace(lora=LoRAContext(meta, slots))
    hidden = torch.empty(num_tokens, config.hidden_size, dtype=dtype, device="cuda")
    gen = torch.Generator().manual_seed(3)

    def draw() -> None:
        hidden.copy_(torch.randn(num_tokens, config.hidden_size, generator=gen))
        loader.load(np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen))).integers(
            -1, 3, num_tokens), slots.slot_ranks)

    draw()
    block(hidden, ctx)  # compiles the kernels and takes the stacks' views outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(hidden, ctx)
    changes = [lambda: None, lambda: slots.write(2, dummy_lora("r4", spec, 4, scale=0.2, seed=4)),  # after capture
               lambda: slots.write(0, dummy_lora("r8", spec, 8, scale=0.2, seed=5)),  # attention-only -> experts
               lambda: slots.write(1, _attention_only(spec, 16, seed=6)), lambda: slots.clear(2)]
    previous = None
    for change in changes:
        change()
        draw()
        graph.replay()
        assert torch.equal(out, block(hidden, ctx))
        assert previous is None or not torch.equal(out, previous)
        previous = out.clone()


@pytest.mark.gpu
def test_cuda_moe_engine_captures_decode_graphs_and_matches_eager(moe_checkpoint):
    model_dir, dirs = moe_checkpoint
    requests = mixed_requests(dirs, seed=1)
    eager = LLMEngine(model_dir, device="cuda", enforce_eager=True, **ENGINE)
    assert eager.runner.decode_graphs is None
    want = run_to_completion(eager, requests, per_step=3)
    eager.close()
    graphed = LLMEngine(model_dir, device="cuda", gpu_memory_utilization=0.5, **ENGINE)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and len(graphs) == len(graphs.plan.keys())
    check_same(want, run_to_completion(graphed, requests, per_step=3))
    assert graphs.num_replays >= 5
    torch.cuda.synchronize()
