"""Ahead-of-time compilation of every Triton kernel configuration the engine launches, no GPU needed.

```
configs = collect_configs(all_drivers())   # {key: KernelConfig}, launches recorded, nothing run
report = compile_config(config, TARGETS[0])  # PTX + cubin for sm_90a; registers/spills from ptxas -v
```
Configurations are never restated: ``record_launches`` intercepts ``JITFunction.run`` (and the
interpreter's twin, which the launchers pick for CPU tensors) and specializes the arguments with
Triton's own binder, exactly as the JIT would on a GPU (dtypes, ints equal to 1, 16-divisible ints
and pointers), so a new block size, split or slice count a launcher chooses is covered as soon as
a driver reaches it. A driver calls a launcher with representative CPU tensors (bf16 included:
nothing runs); ``all_drivers`` lists them, and covering a new kernel means adding its drivers there.

A tool, not a kernel (tests, benchmarks/kernel_report.py; nothing in the serving path imports it): it
lives in ``kernel_tools`` beside ``punica_kernels``, so the kernel package imports nothing of the
engine, while this module may import the model's kernels (paged attention) at the top.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource, make_backend
from triton.runtime.autotuner import Autotuner
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction, create_function_from_signature

from adapters.spec import ModelSpec
from lora_runner.model import paged_attention
from lora_runner.model.lora_linear import decoder_lora_modules
from punica_kernels import embedding_triton, moe_triton, triton_ops, w4a16_triton
from punica_kernels.host_tiles import TableLoader
from punica_kernels.meta import LoRAMeta
from punica_kernels.scales import Scales


@dataclass(frozen=True)
class Target:
    """A GPU the kernels must compile for, with the per-SM limits occupancy is estimated from."""

    name: str
    capability: int
    smem_per_block: int  # largest dynamic shared memory one block may opt into, bytes
    smem_per_sm: int  # bytes; CUDA reserves 1 KiB of it per resident block
    regs_per_sm: int = 65536
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32
    reg_alloc_unit: int = 256  # registers are allocated per warp in units of 256

    @property
    def gpu_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.capability, 32)


TARGETS = (Target("sm_90", 90, smem_per_block=227 * 1024, smem_per_sm=228 * 1024),  # H100/H200
           Target("sm_80", 80, smem_per_block=163 * 1024, smem_per_sm=164 * 1024))  # A100
_SMEM_RESERVED_PER_BLOCK = 1024
# CUDA arg specialization (pointer/int alignment, ints equal to 1) is the same for every capability
_SPECIALIZER = make_backend(TARGETS[0].gpu_target)


@dataclass(frozen=True)
class KernelConfig:
    """One compiled variant of a kernel: what Triton's JIT would key its cache on.

    ``options`` are the launch options the launcher passed (num_warps, num_stages, ...).
    """

    kernel: JITFunction
    signature: dict[str, str] = field(hash=False, compare=False)  # param name -> "*bf16", "i32", "constexpr"
    constexprs: dict[tuple, object] = field(hash=False, compare=False)  # (param index,) -> value
    attrs: dict[tuple, list] = field(hash=False, compare=False)  # (param index,) -> [["tt.divisibility", 16]]
    options: tuple[tuple[str, object], ...] = ()
    key: str = ""  # source hash + options: equal keys compile to the same binary

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__

    def source(self) -> ASTSource:
        return ASTSource(self.kernel, self.signature, self.constexprs, self.attrs)

    def named_constexprs(self) -> dict[str, object]:
        """The kernel's declared tl.constexpr parameters by name (not ints Triton folded to 1)."""
        return {p.name: self.constexprs[(p.num,)] for p in self.kernel.params if p.is_constexpr}

    def dtypes(self) -> str:
        """Element types of the pointer arguments that are not int index buffers, e.g. 'bf16,fp32'."""
        types = dict.fromkeys(t[1:] for t in self.signature.values() if t.startswith("*") and "i" not in t)
        return ",".join(types)


_JIT_OF: dict[Callable, JITFunction] = {}  # python function -> the JITFunction that compiles it


def _resolve_jit(kernel) -> JITFunction:
    """The JITFunction behind a launched kernel (the interpreter twin the launchers use on CPU included)."""
    if isinstance(kernel, JITFunction):
        return kernel
    if kernel.fn not in _JIT_OF:
        module = sys.modules[kernel.fn.__module__]
        found = [v for v in vars(module).values() if isinstance(v, JITFunction) and v.fn is kernel.fn]
        # none when the module was imported under TRITON_INTERPRET=1: rebuild it with its jit kwargs
        _JIT_OF[kernel.fn] = found[0] if found else JITFunction(kernel.fn, **kernel.kwargs)
    return _JIT_OF[kernel.fn]


class _Recorder:
    """Specializes launches as Triton's JIT does on a CUDA device, keeping one config per variant."""

    def __init__(self) -> None:
        self.configs: dict[str, KernelConfig] = {}
        self._seen: set[tuple] = set()  # (kernel, specialization, options): skips repeat launches fast
        self._binders: dict[JITFunction, Callable] = {}

    def record(self, kernel: JITFunction, args: tuple, kwargs: dict) -> None:
        if kernel not in self._binders:
            self._binders[kernel] = create_function_from_signature(kernel.signature, kernel.params, _SPECIALIZER)
        kwargs = {"debug": kernel.debug, **kwargs}
        bound_args, specialization, launch_options = self._binders[kernel](*args, **kwargs)
        option_items = tuple(sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names))
        seen_key = (kernel, tuple(specialization), option_items)
        if seen_key in self._seen:
            return
        self._seen.add(seen_key)
        _, signature, constexprs, attrs = kernel._pack_args(_SPECIALIZER, kwargs, bound_args, specialization,
                                                            launch_options)
        source = ASTSource(kernel, signature, constexprs, attrs)
        key = f"{source.hash()}-{option_items}"
        self.configs.setdefault(key, KernelConfig(kernel, signature, constexprs, attrs, option_items, key))


@contextlib.contextmanager
def record_launches() -> Iterator[dict[str, KernelConfig]]:
    """Within the block, Triton launches run nothing and add their config to the yielded dict.

    The dict maps ``KernelConfig.key`` to the config (deduplicated). Compiled and interpreted
    kernels are both intercepted; an autotuned kernel records every one of its configs. Not
    thread-safe: it patches Triton's classes for the duration.
    """
    recorder = _Recorder()

    def record(self, *args, grid, warmup, **kwargs):
        recorder.record(_resolve_jit(self), args, kwargs)

    def record_every_config(self, *args, **kwargs):
        for config in self.configs:  # each is a variant the autotuner may pick on some device
            self.fn.run(*args, **kwargs, **config.all_kwargs())

    saved = JITFunction.run, InterpretedFunction.run, Autotuner.run
    JITFunction.run = InterpretedFunction.run = record
    Autotuner.run = record_every_config
    try:
        yield recorder.configs
    finally:
        JITFunction.run, InterpretedFunction.run, Autotuner.run = saved


@dataclass(frozen=True)
class KernelReport:
    """Resource use of one config compiled for one target (registers and spills from ptxas -v)."""

    config: KernelConfig
    target: Target
    num_warps: int
    shared: int  # bytes of shared memory per block
    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    ptxas_log: str
    ptx: str = ""  # the PTX ptxas read (ptx_loads parses its loops)

    @property
    def fits_shared(self) -> bool:
        return self.shared <= self.target.smem_per_block

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    def blocks_per_sm(self) -> int:
        """Resident blocks per SM allowed by threads, registers and shared memory (an estimate)."""
        target, warps = self.target, self.num_warps
        unit = target.reg_alloc_unit
        regs_per_warp = -(-self.registers * 32 // unit) * unit
        limits = [target.blocks_per_sm, target.threads_per_sm // (32 * warps),
                  target.regs_per_sm // (regs_per_warp * warps) if regs_per_warp else target.blocks_per_sm,
                  target.smem_per_sm // (self.shared + _SMEM_RESERVED_PER_BLOCK)]
        return min(limits)

    def warps_per_sm(self) -> int:
        return self.blocks_per_sm() * self.num_warps

    def occupancy(self) -> float:
        """Resident warps over the SM's maximum (64 warps on sm_80/sm_90)."""
        return self.warps_per_sm() / (self.target.threads_per_sm // 32)


def compile_config(config: KernelConfig, target: Target) -> KernelReport:
    """Compile for ``target`` (raises on failure) and read its resource use from ptxas -v."""
    backend = make_backend(target.gpu_target)
    options = backend.parse_options(dict(config.options))
    compiled = triton.compile(config.source(), target=target.gpu_target, options=options.__dict__)
    registers, stores, loads, log = ptxas_usage(compiled.asm["ptx"], target.capability)
    return KernelReport(config, target, compiled.metadata.num_warps, compiled.metadata.shared, registers,
                        stores, loads, log, compiled.asm["ptx"])


_USAGE = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(ptx: str, capability: int) -> tuple[int, int, int, str]:
    """(registers, spill store bytes, spill load bytes, log) of the wheel's ptxas -v on ``ptx``.

    The flags match Triton's own cubin step (triton/backends/nvidia/compiler.py make_cubin).
    """
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        command = [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",
                   f"--gpu-name={sm_arch_from_capability(capability)}", str(source), "-o", str(source) + ".o"]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    registers, spills = _USAGE.findall(log), _SPILLS.findall(log)
    assert len(registers) == 1 and len(spills) == 1, f"expected one kernel in ptxas output:\n{log}"
    return int(registers[0]), int(spills[0][0]), int(spills[0][1]), log


_BLOCK_START = re.compile(r"^(?:\$L__BB\d+_\d+:|// %bb\.\d+:)")
_INSTRUCTION = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.:]*)", re.M)
_HALF_TYPES = {"b16", "u16", "s16", "f16", "bf16"}


@dataclass(frozen=True)
class PtxLoads:
    """Global memory instructions of a kernel's PTX, those inside loops counted apart.

    Loops are found from LLVM's own annotations on the PTX's basic blocks: a loop's header block is
    marked ``// =>This Loop Header`` (``This Inner Loop Header`` for an innermost one, the K and rank
    loops), every other block of a loop ``//   in Loop: Header=...`` or ``//   Parent Loop ...``; a
    block's instructions are inside a loop when its annotation names one. ``scalar_half_in_loops``
    counts ``ld.global`` of one 16-bit element there (no ``.v2``/``.v4``): a load Triton could not
    vectorize, hence not pipeline with cp.async.
    """

    loops: int  # loop headers found
    inner_loops: int  # innermost loops (the K loop of the shrink, the rank loop of the expand)
    scalar_half_in_loops: int  # ld.global.{b16,u16,...} without a vector width, inside loops
    scalar_half_stores: int  # st.global of one 16-bit element anywhere (y's store)
    cp_async: int  # cp.async copies (global -> shared, pipelined)
    vector_global: int  # ld/st.global with .v2/.v4 anywhere
    global_loads: int  # ld.global instructions anywhere, any width (cp.async copies apart)


def ptx_blocks(ptx: str) -> list[tuple[str, list[str]]]:
    """The PTX's basic blocks: (label and LLVM's comments on it, instruction mnemonics)."""
    blocks: list[tuple[str, list[str]]] = [("entry", [])]
    for line in ptx.splitlines():
        stripped = line.strip()
        if _BLOCK_START.match(stripped):
            blocks.append((stripped, []))
        elif stripped.startswith("//") and not blocks[-1][1]:  # a comment line of the block's label
            blocks[-1] = (blocks[-1][0] + " " + stripped, blocks[-1][1])
        elif (match := _INSTRUCTION.match(line)) and not stripped.startswith("."):
            blocks[-1][1].append(match.group(1))
    return blocks


def ptx_loops(ptx: str) -> list[list[str]]:
    """The instruction mnemonics of each basic block inside a loop (see :class:`PtxLoads`)."""
    return [body for label, body in ptx_blocks(ptx) if "Loop" in label]


def _is_scalar_half(mnemonic: str, op: str) -> bool:
    parts = mnemonic.split(".")
    return (mnemonic.startswith(op + ".global") and parts[-1] in _HALF_TYPES
            and not any(p in ("v2", "v4", "v8") for p in parts))


def ptx_loads(ptx: str) -> PtxLoads:
    """Count the PTX's global loads and copies; the loop-resident scalar 16-bit loads are what
    leave a K loop waiting on one DRAM round trip per element row (issue 26)."""
    loops = ptx_loops(ptx)
    everything = _INSTRUCTION.findall(ptx)
    labels = [label for label, _ in ptx_blocks(ptx)]
    return PtxLoads(loops=sum("Loop Header" in label for label in labels),
                    inner_loops=sum("Inner Loop Header" in label for label in labels),
                    scalar_half_in_loops=sum(_is_scalar_half(m, "ld") for body in loops for m in body),
                    scalar_half_stores=sum(_is_scalar_half(m, "st") for m in everything),
                    cp_async=sum(m.startswith("cp.async.") and "shared.global" in m for m in everything),
                    vector_global=sum(m.startswith(("ld.global", "st.global")) and any(
                        p in ("v2", "v4", "v8") for p in m.split(".")) for m in everything),
                    global_loads=sum(m.startswith("ld.global") for m in everything))


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher made it: the kernel's name, its grid and its arguments by name."""

    name: str
    grid: tuple[int, int, int]
    args: dict[str, object]


@contextlib.contextmanager
def trace_launches() -> Iterator[list[Launch]]:
    """Within the block, Triton launches run nothing and are appended, grid and arguments, to the
    yielded list (for grid and bytes accounting; record_launches gives the compiled variants)."""
    launches: list[Launch] = []

    def trace(self, *args, grid, warmup, **kwargs):
        jit = _resolve_jit(self)
        names = [p.name for p in jit.params]
        bound = dict(zip(names, args))
        bound.update((k, v) for k, v in kwargs.items() if k in names)
        grid = grid(bound) if callable(grid) else tuple(grid)
        launches.append(Launch(jit.fn.__name__, (*grid, 1, 1)[:3], bound))

    saved = JITFunction.run, InterpretedFunction.run
    JITFunction.run = InterpretedFunction.run = trace
    try:
        yield launches
    finally:
        JITFunction.run, InterpretedFunction.run = saved


# ---------------------------------------------------------------------------------------------
# Drivers: each calls a launcher with representative arguments; every launch is a config.


@dataclass(frozen=True)
class Driver:
    """A launcher called the way the engine calls it; ``launch()`` runs under record_launches."""

    name: str
    launch: Callable[[], None]


# the decoder's LoRA modules per layer, in order (lora_runner.model.lora_linear declares them)
PACKED_MODULES: tuple[str, ...] = ("qkv", "o", "gate_up", "down")


def _decoder(**sizes) -> ModelSpec:
    """A decoder's ModelSpec from its sizes, with the LoRA modules its layers declare (their shapes are the
    kernels' shapes)."""
    spec = ModelSpec(**sizes)
    return replace(spec, modules=decoder_lora_modules(spec))


# packed modules whose base linear has a bias (Qwen2's q, k, v): the expand reads it (DoRA)
BIASED_MODULES = {"qwen2-0.5b": ("qkv",)}
MODELS = {  # the packed LoRA module shapes (qkv, o, gate_up, down) come from the decoder's LoRA modules
    "llama-7b": _decoder(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32, head_dim=128,
                         intermediate_size=11008, vocab_size=32000),
    "qwen2-0.5b": _decoder(num_layers=24, hidden_size=896, num_heads=14, num_kv_heads=2, head_dim=64,
                           intermediate_size=4864, vocab_size=151936),
}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LORA_RANKS = (8, 16, 64)
MAX_LORAS = 4  # the engine's default; more slots only mean more tiles, hence smaller K splits
DECODE_TOKENS = range(1, 257)  # every decode batch up to 256 sequences: each split-K choice
PREFILL_TOKENS = (512, 2048, 8192)
MAX_SLICES = max(len(spec.slice_sizes(p)) for spec in MODELS.values() for p in PACKED_MODULES)


def sgmv_drivers() -> list[Driver]:
    """One driver per max LoRA rank: add_lora (shrink + expand, with the K split it chooses) with the
    slots' scales and the layer's bias as the engine passes them, and the public shrink/expand halves
    without scales, for every packed module of each model in each dtype, over every decode batch size
    and a few prefills."""
    return [Driver(f"sgmv r{rank}", functools.partial(_drive_sgmv, rank)) for rank in LORA_RANKS]


def _drive_sgmv(rank: int) -> None:
    token_counts = [*DECODE_TOKENS, *PREFILL_TOKENS]
    max_tokens = max(token_counts)
    # as the runner builds it: the workspace, sized for the largest batch, bounds the K split
    meta = LoRAMeta(max_tokens, MAX_LORAS, "cpu", max_rank=rank, max_slices=MAX_SLICES)
    tables = TableLoader(meta)
    layers = [_sgmv_operands(spec, packed, dtype, rank, max_tokens, packed in BIASED_MODULES.get(name, ()))
              for name, spec in MODELS.items() for packed in PACKED_MODULES for dtype in DTYPES]
    for num_tokens in token_counts:
        tables.load(torch.arange(num_tokens) % MAX_LORAS)
        for x, y, inter, lora_a, lora_b, slices, scales in layers:
            x, y, inter = x[:num_tokens], y[:num_tokens], inter[:num_tokens]
            triton_ops.add_lora(y, x, lora_a, lora_b, meta, slices, scales)  # a step with a DoRA slot
            triton_ops.add_lora(y, x, lora_a, lora_b, meta, slices, _plain(scales))  # plain LoRA slots only
            triton_ops.lora_shrink(x, lora_a, meta, inter)
            triton_ops.lora_expand(y, inter, lora_b, meta, slices)


def _sgmv_operands(spec: ModelSpec, packed: str, dtype: torch.dtype, rank: int, max_tokens: int,
                   has_bias: bool) -> tuple:
    """Uninitialized (never read) operands of one packed module, laid out as the engine's slots."""
    slices, num_features = spec.slice_sizes(packed), spec.in_features(packed)
    x = torch.empty(max_tokens, num_features, dtype=dtype)  # [T_max, K]
    y = torch.empty(max_tokens, sum(slices), dtype=dtype)  # [T_max, N]
    inter = torch.empty(max_tokens, len(slices), rank)  # [T_max, n, R] float32
    lora_a = torch.empty(MAX_LORAS, len(slices), rank, num_features, dtype=dtype)  # [L, n, R, K]
    lora_b = torch.empty(MAX_LORAS, sum(slices), rank, dtype=dtype)  # [L, N, R]
    scales = Scales(torch.empty(MAX_LORAS, len(slices)),  # [L, n] float32
                    torch.empty(MAX_LORAS, sum(slices)),  # [L, N] float32
                    torch.empty(sum(slices), dtype=dtype) if has_bias else None)  # [N]
    return x, y, inter, lora_a, lora_b, slices, scales


def _plain(scales: Scales) -> Scales:
    """The scales add_lora gets in a step without DoRA slots: the slices' LoRA scaling only (the
    engine passes no column scales then, lora_runner.model.layers.LoRALinear)."""
    return Scales(scales.slices, None, scales.bias)


def all_drivers() -> list[Driver]:
    """Every Triton launcher of the engine. A new kernel is covered by adding its drivers here."""
    return sgmv_drivers() + paged_attention_drivers() + vocab_lora_drivers() + w4a16_drivers() + moe_drivers()


def vocab_lora_drivers() -> list[Driver]:
    """One driver per max LoRA rank: embed_tokens LoRA's gather shrink over every decode batch size and
    a few prefills, and lm_head LoRA's add_lora (N = vocab size) over every count of sampled rows, as
    the runner lays them out (its second meta sized for max_num_seqs), for each model and dtype."""
    return [Driver(f"vocab lora r{rank}", functools.partial(_drive_vocab_lora, rank)) for rank in LORA_RANKS]


def _drive_vocab_lora(rank: int) -> None:
    token_counts = [*DECODE_TOKENS, *PREFILL_TOKENS]
    meta = LoRAMeta(max(token_counts), MAX_LORAS, "cpu")
    token_tables = TableLoader(meta)
    ids, inter = torch.zeros(max(token_counts), dtype=torch.int64), torch.empty(max(token_counts), 1, rank)
    tables = [torch.empty(MAX_LORAS, spec.vocab_size, rank, dtype=dtype)  # [L, V, R]: A transposed
              for spec in MODELS.values() for dtype in DTYPES]
    for num_tokens in token_counts:
        token_tables.load(torch.arange(num_tokens) % MAX_LORAS)
        for lora_a in tables:
            embedding_triton.embedding_shrink(ids[:num_tokens], lora_a, meta, inter[:num_tokens])
    del tables
    max_rows = max(DECODE_TOKENS)
    rows_meta = LoRAMeta(max_rows, MAX_LORAS, "cpu", max_rank=rank, max_slices=1)
    row_tables = TableLoader(rows_meta)
    heads = [_lm_head_operands(spec, dtype, rank, max_rows) for spec in MODELS.values() for dtype in DTYPES]
    for num_rows in DECODE_TOKENS:
        row_tables.load(torch.arange(num_rows) % MAX_LORAS)
        for x, y, lora_a, lora_b in heads:
            triton_ops.add_lora(y[:num_rows], x[:num_rows], lora_a, lora_b, rows_meta, (y.shape[1],))


def _lm_head_operands(spec: ModelSpec, dtype: torch.dtype, rank: int, max_rows: int) -> tuple:
    """Uninitialized operands of lm_head LoRA, laid out as adapters.vocab_slots: K = hidden, N = V."""
    x = torch.empty(max_rows, spec.hidden_size, dtype=dtype)  # [S_max, hidden]
    y = torch.empty(max_rows, spec.vocab_size, dtype=dtype)  # [S_max, V]
    lora_a = torch.empty(MAX_LORAS, 1, rank, spec.hidden_size, dtype=dtype)  # [L, 1, R, hidden]
    lora_b = torch.empty(MAX_LORAS, spec.vocab_size, rank, dtype=dtype)  # [L, V, R]
    return x, y, lora_a, lora_b


W4A16_GROUP_SIZE = 128  # the group size of every 4-bit format the loader takes (GPTQ, AWQ, compressed-tensors)
W4A16_FORMATS = {"symmetric": (False, False), "zeros": (True, False), "act-order": (False, True),
                 "zeros+act-order": (True, True)}  # (zero points, g_idx): every variant the layout allows


def w4a16_drivers() -> list[Driver]:
    """One driver per model: the W4A16 GEMM of every packed base layer (qkv, o, gate_up, down; Qwen2's
    qkv with its bias) in each dtype and 4-bit format, over every decode batch size and a few prefills."""
    return [Driver(f"w4a16 {name}", functools.partial(_drive_w4a16, name)) for name in MODELS]


def _drive_w4a16(model: str) -> None:
    spec = MODELS[model]
    token_counts = [*DECODE_TOKENS, *PREFILL_TOKENS]
    max_tokens = max(token_counts)
    for packed in PACKED_MODULES:
        out_features, in_features = sum(spec.slice_sizes(packed)), spec.in_features(packed)
        groups = in_features // W4A16_GROUP_SIZE
        for dtype in DTYPES:
            x = torch.empty(max_tokens, in_features, dtype=dtype)  # [T_max, K]
            out = torch.empty(max_tokens, out_features, dtype=dtype)  # [T_max, N]
            qweight = torch.empty(out_features, in_features // 8, dtype=torch.int32)  # [N, K/8]
            scales = torch.empty(out_features, groups, dtype=dtype)  # [N, K/G]
            bias = torch.empty(out_features, dtype=dtype) if packed in BIASED_MODULES.get(model, ()) else None
            for has_zeros, has_g_idx in W4A16_FORMATS.values():
                zeros = torch.empty(out_features, groups, dtype=torch.uint8) if has_zeros else None  # [N, K/G]
                g_idx = torch.empty(in_features, dtype=torch.int32) if has_g_idx else None  # [K]
                for num_tokens in token_counts:
                    w4a16_triton.w4a16_matmul(x[:num_tokens], qweight, scales, zeros, g_idx, W4A16_GROUP_SIZE,
                                              bias, out[:num_tokens])



@dataclass(frozen=True)
class MoEShape:
    """The routed experts of one MoE model: what the fused MoE kernels' configs depend on."""

    hidden: int
    intermediate: int  # each expert's
    num_experts: int
    top_k: int
    float_weights: bool  # the routing weights as the model passes them: float32 (Mixtral) or the model dtype (Qwen)


MOE_MODELS = {"qwen3-30b-a3b": MoEShape(hidden=2048, intermediate=768, num_experts=128, top_k=8, float_weights=False),
              "mixtral-8x7b": MoEShape(hidden=4096, intermediate=14336, num_experts=8, top_k=2, float_weights=True)}
MOE_LORA_RANKS = (16, 64)  # each rank is a constexpr variant of shrink and expand: the usual and the widest
MOE_TOKENS = (4, 512)  # a decode batch and a prefill: each of the block sizes moe_triton.block_m_for picks


def moe_drivers() -> list[Driver]:
    """One driver per MoE model: moe_triton.fused_moe (alignment, both grouped GEMMs) in each dtype, without
    LoRA and with expert LoRA of each rank in MOE_LORA_RANKS (shrink and expand of gate_up and down), and
    with FP8 experts (quantization="fp8": the GEMMs' W_FP8 variant; the LoRA ops are the same), at a
    decode and a prefill size. Weights are broadcast views (stride 0 over experts and slots, which Triton
    specializes as it would the real, 16-divisible strides): nothing is allocated at the models' sizes."""
    return [Driver(f"fused moe {name}", functools.partial(_drive_moe, shape)) for name, shape in MOE_MODELS.items()]


def _drive_moe(shape: MoEShape) -> None:
    hidden, inter, experts, top_k = shape.hidden, shape.intermediate, shape.num_experts, shape.top_k
    fp8 = torch.float8_e4m3fn
    fp8_weights = (torch.empty(1, 2 * inter, hidden, dtype=fp8).expand(experts, -1, -1),  # [E, 2I, H]
                   torch.empty(1, hidden, inter, dtype=fp8).expand(experts, -1, -1))  # [E, H, I]
    fp8_scales = (torch.empty(1, 2 * inter).expand(experts, -1), torch.empty(1, hidden).expand(experts, -1))
    for dtype in DTYPES:
        w_gate_up = torch.empty(1, 2 * inter, hidden, dtype=dtype).expand(experts, -1, -1)  # [E, 2I, H]
        w_down = torch.empty(1, hidden, inter, dtype=dtype).expand(experts, -1, -1)  # [E, H, I]
        for num_tokens in MOE_TOKENS:
            x = torch.empty(num_tokens, hidden, dtype=dtype)  # [T, H]
            topk_ids = (torch.arange(num_tokens * top_k) % experts).view(num_tokens, top_k)  # [T, k]
            topk_weights = torch.empty(num_tokens, top_k, dtype=torch.float32 if shape.float_weights else dtype)
            moe_triton.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
            moe_triton.fused_moe(x, *fp8_weights, topk_weights, topk_ids, scales=fp8_scales)
            token_slots = torch.arange(num_tokens) % MAX_LORAS  # [T]
            slot_ranks = torch.empty(MAX_LORAS, dtype=torch.int32)
            for rank in MOE_LORA_RANKS:
                gate_up = _moe_lora_operands(MAX_LORAS, experts, 2, 2 * inter, hidden, rank, dtype)
                down = _moe_lora_operands(MAX_LORAS, experts, 1, hidden, inter, rank, dtype)
                moe_triton.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids,
                                     (token_slots, slot_ranks, gate_up, down))


def _moe_lora_operands(slots: int, experts: int, n_slices: int, out_features: int, in_features: int, rank: int,
                       dtype: torch.dtype) -> tuple:
    """Never-read expert LoRA factors as moe_triton takes them (lora_a [L, E, n, R, K], lora_b [L, E, N, R],
    slice_scales [L, E, n]), broadcast over slots and experts."""
    return (torch.empty(1, 1, n_slices, rank, in_features, dtype=dtype).expand(slots, experts, -1, -1, -1),
            torch.empty(1, 1, out_features, rank, dtype=dtype).expand(slots, experts, -1, -1),
            torch.empty(1, 1, n_slices).expand(slots, experts, -1))

ATTENTION_BLOCK_SIZES = (16, 32)
SLIDING_WINDOWS = (None, 1024)
# Attention shapes -> the soft-caps they are driven with (Gemma 2's logit soft-capping is a constexpr
# kernel variant): Gemma 2 always caps; its 27B has 128-wide heads (as llama-7b here), 2B/9B 256-wide
# ones (their own tile sizes). Each variant costs compile time in tests/test_kernels_compile.py.
ATTENTION_MODELS = {
    "llama-7b": (MODELS["llama-7b"], (None, 50.0)),
    "qwen2-0.5b": (MODELS["qwen2-0.5b"], (None,)),
    "gemma2-2b": (_decoder(num_layers=26, hidden_size=2304, num_heads=8, num_kv_heads=4, head_dim=256,
                           intermediate_size=9216), (50.0,)),
}
# block-table capacities in tokens: a short one (at most 2 splits; its width in blocks is not a multiple
# of 16, a variant the JIT specializes separately) and a long one that lets decode reach MAX_SPLITS
ATTENTION_CAPACITIES = (900, 32768)
ATTENTION_PREFILL = (512, (300, 212))  # one prefill step: its flat tokens, and the chunk of each sequence


def paged_attention_drivers() -> list[Driver]:
    """Decode (with the split combine it launches) and prefill attention for both model shapes,
    every dtype, KV block size and table capacity, over every decode batch size (each split count
    decode_num_splits can choose), with and without a sliding window and logit soft-capping."""
    return [Driver(f"paged attention {name}", functools.partial(_drive_attention, spec, softcaps))
            for name, (spec, softcaps) in ATTENTION_MODELS.items()]


def _drive_attention(spec: ModelSpec, softcaps: tuple[float | None, ...]) -> None:
    max_seqs = max(DECODE_TOKENS)
    scale = spec.head_dim ** -0.5
    for dtype in DTYPES:
        for block_size in ATTENTION_BLOCK_SIZES:
            for capacity in ATTENTION_CAPACITIES:
                kv, tables = _attention_cache(spec, dtype, block_size, capacity, max_seqs)
                query = torch.empty(max_seqs, spec.num_heads, spec.head_dim, dtype=dtype)  # [B_max, H, D]
                seq_lens = torch.empty(max_seqs, dtype=torch.int32)
                for window, softcap in itertools.product(SLIDING_WINDOWS, softcaps):
                    for num_seqs in DECODE_TOKENS:
                        paged_attention.decode_attention(query[:num_seqs], kv, tables[:num_seqs],
                                                         seq_lens[:num_seqs], scale, window, softcap=softcap)
                    _drive_prefill(spec, kv, tables, dtype, scale, window, softcap)


def _attention_cache(spec: ModelSpec, dtype: torch.dtype, block_size: int, capacity: int,
                     max_seqs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (never read) one-layer KV cache and the block-table buffer, laid out as the runner's."""
    max_blocks = -(-capacity // block_size)
    kv = torch.empty(2, 4, block_size, spec.num_kv_heads, spec.head_dim, dtype=dtype)  # [2, blocks, bs, Hkv, D]
    return kv, torch.zeros(max_seqs, max_blocks, dtype=torch.int32)  # [B_max, max_blocks]


def _drive_prefill(spec: ModelSpec, kv: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype,
                   scale: float, window: int | None, softcap: float | None) -> None:
    num_tokens, chunks = ATTENTION_PREFILL
    query = torch.empty(num_tokens, spec.num_heads, spec.head_dim, dtype=dtype)  # [T, H, D]
    starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)  # [B+1]
    seq_lens = torch.tensor(chunks, dtype=torch.int32)
    paged_attention.prefill_attention(query, kv, tables[:len(chunks)], seq_lens, starts, max(chunks), scale,
                                      window, softcap=softcap)


def invariant_drivers() -> list[Driver]:
    """The batch-invariant mode's kernels at their widest (EngineConfig.batch_invariant on CUDA): the fixed-config
    GEMM and the row RMSNorm in each dtype, the sampler's row softmax and log-softmax, its row scan (top-p) and
    ordered selection (argmax, top logprobs, the MoE router's top-k), and the prefill attention with key tiles
    at fixed positions (window and cap on) for the widest heads. Kept out of all_drivers so the
    full compile grid stays as it was (tests/test_batch_invariant_triton.py compiles these)."""
    return [Driver("batch-invariant gemm, rms norm and softmax", _drive_invariant),
            Driver("batch-invariant attention", _drive_invariant_attention),
            Driver("batch-invariant sampler scan and selection", _drive_invariant_sampling)]


def _drive_invariant() -> None:
    from punica_kernels import invariant_triton

    spec = MODELS["llama-7b"]
    for dtype in DTYPES:
        x = torch.empty(PREFILL_TOKENS[0], spec.hidden_size, dtype=dtype)  # [T, K]; M is never specialized
        invariant_triton.matmul(x, torch.empty(spec.intermediate_size, spec.hidden_size, dtype=dtype),
                                torch.empty(spec.intermediate_size, dtype=dtype))
        for width in (spec.hidden_size, 2 * spec.hidden_size):  # up to 8192 (70B-class models)
            invariant_triton.rms_norm(x.new_empty(1, width), torch.empty(width, dtype=dtype), 1e-6)
    for log in (False, True):  # the sampler's, on float32 logits
        invariant_triton.softmax(torch.empty(4, spec.vocab_size), log)


def _drive_invariant_sampling() -> None:
    from punica_kernels import invariant_sampling

    logits = torch.empty(4, MODELS["llama-7b"].vocab_size)  # [S, V] float32, as the sampler's
    invariant_sampling.cumsum(logits)  # the top-p mass
    invariant_sampling.top(logits, 20)  # argmax (k = 1) and the top logprobs: k is not specialized
    for dtype in DTYPES:  # the MoE router's top-k runs on float32 probabilities; half rows for completeness
        invariant_sampling.top(torch.empty(4, 128, dtype=dtype), 8)


def _drive_invariant_attention() -> None:
    spec, (softcap,) = ATTENTION_MODELS["gemma2-2b"]
    for dtype in DTYPES:
        kv, tables = _attention_cache(spec, dtype, ATTENTION_BLOCK_SIZES[0], ATTENTION_CAPACITIES[0], 2)
        num_tokens, chunks = ATTENTION_PREFILL
        query = torch.empty(num_tokens, spec.num_heads, spec.head_dim, dtype=dtype)  # [T, H, D]
        starts = torch.tensor([0, *itertools.accumulate(chunks)], dtype=torch.int32)  # [B+1]
        paged_attention.prefill_attention(query, kv, tables, torch.tensor(chunks, dtype=torch.int32), starts,
                                          max(chunks), spec.head_dim ** -0.5, SLIDING_WINDOWS[-1], softcap=softcap,
                                          aligned_keys=True)


def collect_configs(drivers: list[Driver]) -> dict[str, KernelConfig]:
    """Every distinct config the drivers launch, keyed by KernelConfig.key."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the drivers' small CPU ops only lose to thread-pool wake-ups
    try:
        with record_launches() as configs:
            for driver in drivers:
                driver.launch()
    finally:
        torch.set_num_threads(threads)
    return configs


# ---------------------------------------------------------------------------------------------
# Decode accounting: the SGMV launches of one decode step, traced, against the real meta buffers.

# The GPU run's model (benchmarks/gpu_check.py): hidden 4096, MLP 11008, 32/8 heads, rank-16 adapters,
# max_loras 32, max_num_batched_tokens 8192, bf16.
GPU_CHECK = _decoder(num_layers=8, hidden_size=4096, num_heads=32, num_kv_heads=8, head_dim=128,
                     intermediate_size=11008, vocab_size=32000)
GPU_CHECK_MAX_LORAS, GPU_CHECK_RANK, GPU_CHECK_MAX_TOKENS = 32, 16, 8192


@dataclass(frozen=True)
class LaunchWork:
    """A traced SGMV launch: its grid's programs, those that have a tile to work on, and the bytes
    those programs read and write (each masked load or store counted for the elements it moves)."""

    launch: Launch
    programs: int
    with_work: int
    bytes_moved: int


@dataclass(frozen=True)
class ModuleStep:
    """One packed module's add_lora in a decode step: its shrink and expand, and the ideal bytes
    (A and B of the slots used, x and y's LoRA rows read, y's written)."""

    packed: str
    shrink: LaunchWork
    expand: LaunchWork
    ideal_bytes: int

    @property
    def bytes_ratio(self) -> float:
        return (self.shrink.bytes_moved + self.expand.bytes_moved) / self.ideal_bytes


def _round_rank(rank: int, padded: int) -> int:
    return min(-(-rank // 16) * 16, padded)


def _tile_table(args: dict) -> tuple[list[int], list[int], list[int], list[int]]:
    return (args["tile_slots_ptr"].tolist(), args["tile_starts_ptr"].tolist(), args["tile_ends_ptr"].tolist(),
            args["slot_ranks_ptr"].tolist())


def _programs_tiles(launch: Launch) -> list[list[int]]:
    """The tiles with a slot that each program along the tile axis visits (g, g + G, ...)."""
    slots = launch.args["tile_slots_ptr"].tolist()
    num_tiles, programs = launch.args["num_tiles"], launch.grid[0]
    return [[t for t in range(g, num_tiles, programs) if slots[t] >= 0] for g in range(programs)]


def shrink_work(launch: Launch) -> LaunchWork:
    """Programs with work and bytes moved of a traced _shrink_kernel launch."""
    args = launch.args
    slots, starts, ends, ranks = _tile_table(args)
    x = args["x_ptr"]
    es, num_features = x.element_size(), args["num_features"]
    n, padded = args["N_SLICES"], args["RANK"]
    chunk = args["k_blocks_per_split"] * args["BLOCK_K"]
    splits = launch.grid[1]
    with_work = moved = 0
    for tiles in _programs_tiles(launch):
        for split in range(splits):
            k_len = max(0, min(num_features, (split + 1) * chunk) - split * chunk)
            with_work += bool(tiles) and k_len > 0
            for t in tiles:
                rows, rank = ends[t] - starts[t], _round_rank(ranks[slots[t]], padded)
                moved += rows * k_len * es + n * rank * k_len * es  # x and A
                moved += rows * n * padded * 4  # the partial (or, unsplit, the result)
    for t in {t for tiles in _programs_tiles(launch) for t in tiles} if args["SPLIT"] else ():
        moved += (splits + 1) * (ends[t] - starts[t]) * n * padded * 4  # the last split's sum
    return LaunchWork(launch, launch.grid[0] * launch.grid[1], with_work, moved)


def expand_work(launch: Launch) -> LaunchWork:
    """Programs with work and bytes moved of a traced _expand_kernel launch."""
    args = launch.args
    slots, starts, ends, ranks = _tile_table(args)
    es, padded, block_n = args["y_ptr"].element_size(), args["RANK"], args["BLOCK_N"]
    offsets = args["slice_offsets_ptr"].tolist()
    column_blocks = [min(block_n, offsets[j + 1] - offsets[j] - n0)
                     for j in range(len(offsets) - 1) for n0 in range(0, offsets[j + 1] - offsets[j], block_n)]
    assert len(column_blocks) == launch.grid[1], "the expand's grid covers each slice's column blocks once"
    with_work = moved = 0
    for tiles in _programs_tiles(launch):
        tiles = [t for t in tiles if _round_rank(ranks[slots[t]], padded) > 0]
        with_work += len(column_blocks) if tiles else 0
        for t, cols in itertools.product(tiles, column_blocks):
            rows, rank = ends[t] - starts[t], _round_rank(ranks[slots[t]], padded)
            moved += rows * rank * 4 + rank * cols * es  # the intermediate and B
            moved += 2 * rows * cols * es  # y read and written
            if args["HAS_COLUMN_SCALES"]:  # DoRA's epilogue: the slot's column scales and the bias
                moved += cols * 4 + (cols * es if args["HAS_BIAS"] else 0)
    return LaunchWork(launch, launch.grid[0] * launch.grid[1], with_work, moved)


def decode_step(num_tokens: int = 32, num_adapters: int = 8, spec: ModelSpec = GPU_CHECK,
                max_loras: int = GPU_CHECK_MAX_LORAS, rank: int = GPU_CHECK_RANK,
                max_num_tokens: int = GPU_CHECK_MAX_TOKENS, dtype: torch.dtype = torch.bfloat16,
                dora: bool = False) -> list[ModuleStep]:
    """Trace add_lora of every packed module for a decode step of ``num_tokens`` sequences spread
    round-robin over ``num_adapters`` adapters (a real table on the runner's meta), nothing run;
    ``dora``: a step with a DoRA slot resident (column scales passed), else plain LoRA slots."""
    meta = LoRAMeta(max_num_tokens, max_loras, "cpu", max_rank=rank, max_slices=MAX_SLICES)
    token_slots = torch.arange(num_tokens) % num_adapters  # [T]
    TableLoader(meta).load(token_slots, torch.full((max_loras,), rank, dtype=torch.int32))
    steps = []
    for packed in PACKED_MODULES:
        x, y, _, lora_a, lora_b, slices, scales = _sgmv_operands(spec, packed, dtype, rank, num_tokens, False)
        with trace_launches() as launches:
            triton_ops.add_lora(y, x, lora_a, lora_b, meta, slices, scales if dora else _plain(scales))
        shrink, expand = launches
        es, num_features, width = x.element_size(), x.shape[1], y.shape[1]
        used = token_slots.unique().numel()
        ideal = used * rank * es * (len(slices) * num_features + width) + num_tokens * es * (num_features + 2 * width)
        steps.append(ModuleStep(packed, shrink_work(shrink), expand_work(expand), ideal))
    return steps
