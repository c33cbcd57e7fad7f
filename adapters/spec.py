"""The base model's LoRA layout as adapters see it: one descriptor per LoRA-capable module, declared by
the model's layers (``lora_runner.model.lora_linear``) and collected into a :class:`ModelSpec`.

A :class:`LoRAModule` says everything the adapter code needs about one module of one layer, and
nothing about which model it is: the PEFT module paths it answers to and the slices each covers
(a packed q,k,v linear answers to ``q_proj`` (slice 0), ``k_proj`` (1), ``v_proj`` (2); Phi-3's
fused ``qkv_proj`` to all three: its A is shared by the slices, its B rows are theirs in order),
its slice output sizes and input size, and how it splits over tensor-parallel ranks
(:class:`Split`; the A/B rule is adapters.sharding's). Device slots hold, per module,
``lora_a [max_loras, n_slices, R, K]`` and ``lora_b [max_loras, N, R]`` (design.md section 3).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

Range = tuple[int, int]  # [start, end)

COLUMN, ROW, REPLICATED = "column", "row", "replicated"  # LoRAModule.parallel


@dataclass(frozen=True)
class Split:
    """How one dimension of a module splits over tensor-parallel ranks: ``units`` blocks of
    ``unit_size`` (attention heads of head_dim elements, or single rows). Each rank holds an even
    share of the units; with ``replicate`` and fewer units than ranks (KV heads) each unit is held by
    ``world_size / units`` ranks, rank r holding unit ``r * units // world_size`` (vLLM's rule)."""

    units: int
    unit_size: int = 1
    what: str = "rows"  # names the size in messages ("num_attention_heads")
    replicate: bool = False

    @property
    def size(self) -> int:
        """Elements of the whole dimension."""
        return self.units * self.unit_size

    def check(self, world_size: int) -> None:
        """ValueError naming the sizes when the units cannot be split over ``world_size`` ranks."""
        if self.replicate and self.units < world_size:
            if world_size % self.units:
                raise ValueError(f"tensor_parallel_size ({world_size}) is not a multiple of {self.what} "
                                 f"({self.units}): fewer KV heads than ranks are replicated, which needs an even "
                                 "share")
        elif self.units % world_size:
            raise ValueError(f"{self.what} ({self.units}) is not divisible by tensor_parallel_size ({world_size})")

    def unit_range(self, rank: int, world_size: int) -> Range:
        """The units ``rank`` holds: its even share, or the one replicated unit."""
        if self.replicate and self.units < world_size:
            unit = rank * self.units // world_size
            return unit, unit + 1
        share = self.units // world_size
        return rank * share, (rank + 1) * share

    def range(self, rank: int, world_size: int) -> Range:
        """The elements ``rank`` holds."""
        start, end = self.unit_range(rank, world_size)
        return start * self.unit_size, end * self.unit_size


@dataclass(frozen=True)
class LoRAModule:
    """One LoRA-capable module of one layer, as that layer declares it.

    ``peft_modules``: (PEFT module path from the model root, e.g. "model.layers.0.self_attn.q_proj",
    indices of the slices it covers). ``parallel``: COLUMN (output rows split: per slice
    ``out_splits``), ROW (input columns split: ``in_split``; outputs all-reduced) or REPLICATED. A
    rank's own descriptor (:meth:`shard`) has the rank's sizes and no splits."""

    layer: int
    name: str  # the module's slot key within its layer ("qkv")
    in_features: int
    slice_sizes: tuple[int, ...]
    peft_modules: tuple[tuple[str, tuple[int, ...]], ...]
    parallel: str = REPLICATED
    out_splits: tuple[Split, ...] = ()
    in_split: Split | None = None

    def __post_init__(self) -> None:
        assert self.in_features > 0 and self.slice_sizes and all(s > 0 for s in self.slice_sizes), self
        assert self.parallel in (COLUMN, ROW, REPLICATED), f"parallel must be column, row or replicated: {self}"
        for path, indices in self.peft_modules:
            assert indices and all(0 <= i < len(self.slice_sizes) for i in indices), f"{path}: slices {indices}"
        if self.out_splits:
            assert tuple(s.size for s in self.out_splits) == self.slice_sizes, f"out_splits of {self.key}"
        if self.in_split is not None:
            assert self.in_split.size == self.in_features, f"in_split of {self.key}"

    @property
    def key(self) -> tuple[int, str]:
        """(layer, name): where this module's factors sit in LoRAWeights.modules and the slots."""
        return self.layer, self.name

    @property
    def out_features(self) -> int:
        """N: the slices' rows together."""
        return sum(self.slice_sizes)

    @property
    def slice_offsets(self) -> tuple[int, ...]:
        """Row offset of each slice within the module's N rows."""
        return tuple(sum(self.slice_sizes[:j]) for j in range(len(self.slice_sizes)))

    def check_split(self, world_size: int) -> None:
        """ValueError naming the sizes when this module cannot be split over ``world_size`` ranks."""
        if world_size == 1:
            return
        for split in (*self.out_splits, *([self.in_split] if self.in_split is not None else [])):
            split.check(world_size)

    def slice_rows(self, rank: int, world_size: int) -> tuple[Range, ...]:
        """Per slice, the rows of that slice (relative to its start) ``rank`` holds: its share when
        column-parallel, every row otherwise."""
        if self.parallel == COLUMN and world_size > 1:
            return tuple(split.range(rank, world_size) for split in self.out_splits)
        return tuple((0, size) for size in self.slice_sizes)

    def input_columns(self, rank: int, world_size: int) -> Range:
        """The input columns ``rank`` holds (all of them unless row-parallel)."""
        if self.parallel == ROW and world_size > 1:
            return self.in_split.range(rank, world_size)
        return 0, self.in_features

    def shard(self, rank: int, world_size: int) -> LoRAModule:
        """The descriptor of ``rank``'s share: its sizes, no splits (itself at one rank)."""
        if world_size == 1:
            return self
        c0, c1 = self.input_columns(rank, world_size)
        sizes = tuple(r1 - r0 for r0, r1 in self.slice_rows(rank, world_size))
        return replace(self, in_features=c1 - c0, slice_sizes=sizes, out_splits=(), in_split=None)

    def peft_shapes(self, indices: tuple[int, ...], rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Expected (lora_A [r, in], lora_B [out, r]) of a PEFT module covering slices ``indices``."""
        return (rank, self.in_features), (sum(self.slice_sizes[i] for i in indices), rank)


@dataclass(frozen=True)
class ModelSpec:
    """The base model as adapters must agree with it: its LoRA-capable modules (``modules``, collected
    from the model's layers: lora_runner.model.lora_linear), its hidden size (soft prompts), its
    vocabulary (embed_tokens / lm_head LoRA; None: refused) and name.

    ``num_heads``, ``num_kv_heads``, ``head_dim``, ``intermediate_size`` and ``fused_projections``
    are a Llama-family decoder's sizes (None for another model), kept for the code that reads them
    (the KV cache, the kernels' shape tables); the adapter code reads ``modules`` only.
    """

    num_layers: int
    hidden_size: int
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    model_name: str | None = None  # for the "adapter trained on another base" warning
    vocab_size: int | None = None  # embed_tokens / lm_head rows; None: LoRA on them is refused
    fused_projections: bool = False  # Phi-3: modules are named qkv_proj / gate_up_proj
    modules: tuple[LoRAModule, ...] = ()  # every LoRA-capable module of every layer

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size"):
            value = getattr(self, field)
            if value is None and field not in ("num_layers", "hidden_size"):
                continue
            if value <= 0:
                raise ValueError(f"ModelSpec.{field} must be positive")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError("ModelSpec.vocab_size must be positive or None")
        keys = [m.key for m in self.modules]
        if len(set(keys)) != len(keys):
            raise ValueError(f"ModelSpec.modules: two modules share a (layer, name): {keys}")
        paths = [path for m in self.modules for path, _ in m.peft_modules]
        if len(set(paths)) != len(paths):
            raise ValueError("ModelSpec.modules: two modules answer to the same PEFT module")

    def module(self, layer: int, name: str) -> LoRAModule:
        """The descriptor of module ``name`` of ``layer`` (KeyError if the model has none there)."""
        for module in self.modules:
            if module.key == (layer, name):
                return module
        raise KeyError(f"no LoRA-capable module {name!r} in layer {layer}")

    def peft_targets(self) -> dict[str, tuple[LoRAModule, tuple[int, ...]]]:
        """PEFT module path -> (the module answering to it, the slices it covers)."""
        return {path: (module, indices) for module in self.modules for path, indices in module.peft_modules}

    def slice_sizes(self, name: str) -> tuple[int, ...]:
        """Output widths of the slices of the modules called ``name`` (the first layer's)."""
        return self._first(name).slice_sizes

    def in_features(self, name: str) -> int:
        """Input width K of the modules called ``name`` (the first layer's)."""
        return self._first(name).in_features

    def _first(self, name: str) -> LoRAModule:
        for module in self.modules:
            if module.name == name:
                return module
        raise KeyError(f"no LoRA-capable module {name!r} in this ModelSpec (modules: "
                       f"{sorted({m.name for m in self.modules})})")

