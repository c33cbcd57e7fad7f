"""PEFT LoRA checkpoints -> validated per-module A, B and scaling (DoRA: column scale), in the engine's layout.

CPU format (:class:`LoRAWeights`): for each LoRAModule (layer, name) the adapter targets, one entry
per slice of the module (q,k,v for a packed "qkv"; one for "o"):
``LoRAPair(a [r_j, K], b [N_j, r_j], scaling, column_scale)`` with the slice's scaling
(``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA; per module with rank_pattern /
alpha_pattern) kept apart from ``b`` (the kernels apply it to the fp32 intermediate: folding it
into a half ``b`` would round it), or None for a slice the adapter does not target. So the delta
of slice j is ``scaling * x @ a.T @ b.T``, exactly PEFT's ``lora_B(lora_A(x)) * scaling``. For DoRA
(use_dora=True), ``column_scale`` [N_j] float32 is m / ||W + scaling * b @ a|| per output row
(adapters.dora), computed at load from the base weights; the output is then
``column_scale * (x @ W.T + delta) + bias``.

Which modules an adapter may target, and their shapes, is the model's: ``spec.modules``
(adapters.spec.LoRAModule, declared by the model's layers). Supported: plain LoRA (peft_type LORA) on
every PEFT module a LoRAModule answers to (a fused one, as Phi-3's qkv_proj, covers several slices:
its shared A goes to every slice and its B rows are split by slice), DoRA on those covering one
slice, and plain LoRA on embed_tokens / lm_head
(adapters.vocab_lora); target_modules as a list (suffix match) or regex; layers_to_transform / layers_pattern;
exclude_modules; rank_pattern; alpha_pattern; use_rslora; keys with or without the ".default"
adapter segment. Refused with :class:`UnsupportedAdapterError`: DoRA on any other module or without
the base weights (``base_weight``), modules_to_save, bias terms (bias != "none", lora_bias), tied
embed_tokens/lm_head LoRAs, layer_replication, target_parameters on anything but a stacked parameter
the model declares (adapters.stacked: a MoE's fused experts, served as the per-expert LoRA they equal),
trainable tokens, aLoRA, QALoRA, BD-LoRA, Arrow, KaSA, MonteCLoRA, MiCA, and un-converted
PiSSA/OLoRA/CorDA/LoftQ/LoRA-GA adapters (they need a modified base model). Everything is validated
before any slot is touched.

LoRA on embed_tokens and lm_head (per model, in :attr:`LoRAWeights.vocab`): see :mod:`adapters.vocab_lora`.

The config's regexes (target_modules as a string, exclude_modules, layers_pattern, rank_pattern and
alpha_pattern keys) are tenant input: :mod:`adapters.patterns` runs them in RE2 (linear time), never
in Python's backtracking ``re``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import NamedTuple

import torch

from adapters.base_model import warn_if_other_base
from adapters.cache_memory import held_bytes
from adapters.dora import BaseWeight, dora_column_scale
from adapters.errors import AdapterTooLargeError, InvalidAdapterError, UnsupportedAdapterError
from adapters.patterns import PeftTargets
from adapters.spec import LoRAModule, ModelSpec
from adapters.stacked import unstack_config, unstack_parameters
from adapters.vocab_lora import VOCAB_MODULES, check_vocab_target, vocab_factor_shapes, vocab_key_parts
from adapters.files import AdapterDir
from adapters.weights import check_peft_type, held_dir, read_adapter_config, read_adapter_tensors

logger = logging.getLogger(__name__)

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # every scaling is applied in float32 (adapters.slots)
_KEY_RE = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?:(?P<ab>lora_A|lora_B)(?:\.default)?\.weight"
                     r"|(?P<magnitude>lora_magnitude_vector)(?:\.default)?(?:\.weight)?)$")
_LAYER_INDEX_RE = re.compile(r"\.(\d+)\.")  # a module path's first index: its layer (model.layers.3.mlp...)

# Config fields that change what the adapter computes; (field, is-refused predicate, feature name)
_REFUSED_FIELDS = (
    ("modules_to_save", bool, "modules_to_save (whole replacement modules)"),
    ("bias", lambda v: v not in (None, "none"), "bias terms"),
    ("lora_bias", bool, "a bias on lora_B"),
    ("layer_replication", bool, "layer_replication"),
    ("trainable_token_indices", bool, "trainable tokens"),
    ("alora_invocation_tokens", bool, "activated LoRA (aLoRA)"),
    ("use_qalora", bool, "QALoRA"),
    ("use_bdlora", lambda v: v not in (None, False), "BD-LoRA"),
    ("arrow_config", lambda v: v is not None, "Arrow routing"),
    ("kasa_config", lambda v: v is not None, "KaSA"),
    ("monteclora_config", lambda v: v is not None, "MonteCLoRA"),
)
# init methods whose adapter only works on a modified base model (or that enable a LoRA variant)
_REFUSED_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga", "mica")


class LoRAPair(NamedTuple):
    """One slice's factors: delta(x) = scaling * x @ a.T @ b.T; DoRA scales output rows by column_scale."""

    a: torch.Tensor  # [r, K]
    b: torch.Tensor  # [N_j, r]
    scaling: float = 1.0
    column_scale: torch.Tensor | None = None  # [N_j] float32, DoRA only: m / ||W + scaling * b @ a||


@dataclass
class LoRAWeights:
    """A validated LoRA adapter in the engine's CPU format (see module docstring)."""

    name: str
    rank: int  # max rank over the adapter's modules
    modules: dict[tuple[int, str], tuple[LoRAPair | None, ...]]  # LoRAModule.key (layer, name) -> per-slice pair
    # "embed_tokens" / "lm_head" (adapters.vocab_lora)
    vocab: dict[str, LoRAPair] = dataclass_field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of memory the factors (and DoRA column scales) hold: each storage once
        (adapters.cache_memory; a fused module's slices share their A)."""
        return held_bytes(t for pair in self.pairs() for t in (pair.a, pair.b, pair.column_scale))

    def pairs(self) -> list[LoRAPair]:
        """Every slice's pair of every module, then the vocabulary LoRAs'."""
        return [*(pair for slices in self.modules.values() for pair in slices if pair is not None),
                *self.vocab.values()]

    def size(self) -> int:
        """The adapter's size as the manager reports it (its rank)."""
        return self.rank

    def pin_memory(self) -> "LoRAWeights":
        """A copy in page-locked memory, so slot writes to a GPU are asynchronous."""
        pinned: dict[int, torch.Tensor] = {}  # id -> its pinned copy: an A its slices share stays one tensor

        def copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
            if tensor is None:
                return None
            if id(tensor) not in pinned:
                pinned[id(tensor)] = tensor.pin_memory()
            return pinned[id(tensor)]

        def pin(pair: LoRAPair) -> LoRAPair:
            return pair._replace(a=copy(pair.a), b=copy(pair.b), column_scale=copy(pair.column_scale))

        modules = {key: tuple(None if pair is None else pin(pair) for pair in slices)
                   for key, slices in self.modules.items()}
        vocab = {key: pin(pair) for key, pair in self.vocab.items()}
        return LoRAWeights(self.name, self.rank, modules, vocab)


def _candidate_modules(spec: ModelSpec) -> list[str]:
    """Every module of the model that PEFT LoRA can attach to: the vocabulary ones and those its
    LoRA-capable layers answer to."""
    return ["model.embed_tokens", "lm_head", *spec.peft_targets()]


def _layer_free(path: str) -> tuple[str, int | None]:
    """(``path`` with its layer index written N, that index or None): "model.layers.N.mlp.up_proj", 3."""
    match = _LAYER_INDEX_RE.search(path)
    if match is None:
        return path, None
    return f"{path[:match.start()]}.N.{path[match.end():]}", int(match.group(1))


def _supported_text(spec: ModelSpec, dora: bool = False) -> str:
    """What this model serves, for messages: its PEFT modules (layer index as N)."""
    single, fused = {}, {}
    for module in spec.modules:
        for path, indices in module.peft_modules:
            # every index written N (layer, and expert: one entry for a MoE's experts, not one per expert)
            (single if len(indices) == 1 and module.dora else fused)[_LAYER_INDEX_RE.sub(".N.", path)] = None
    if dora:
        return ", ".join(single)
    text = "plain LoRA or DoRA on " + (", ".join(single) or "no module")
    if fused:
        text += " and plain LoRA on " + ", ".join(fused)
    return text + ", and plain LoRA on embed_tokens and lm_head"


def _check_config(name: str, config: dict, spec: ModelSpec) -> None:
    """Refuse configs this engine cannot run; warn if the adapter was trained on another base model."""
    check_peft_type(name, config, "LORA", "a LoRA", _supported_text(spec))
    for field, refused, feature in _REFUSED_FIELDS:
        if refused(config.get(field)):
            raise UnsupportedAdapterError(f"adapter {name!r}: {feature} ({field}={config[field]!r}) is not "
                                          f"supported; supported: {_supported_text(spec)}")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_REFUSED_INITS):
        raise UnsupportedAdapterError(
            f"adapter {name!r}: init_lora_weights={init!r} is not supported: such adapters need a modified "
            "base model or a LoRA variant; convert it to plain LoRA with PEFT's save_pretrained("
            "path_initial_model_for_weight_conversion=...)")
    targets = config.get("target_modules")
    if not (isinstance(targets, str) or isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise InvalidAdapterError(f"adapter {name!r}: target_modules must be a regex string or a list of "
                                  f"module names, got {targets!r}")
    for field in ("r", "lora_alpha"):
        value = config.get(field)
        if not _is_finite_number(value) or value <= 0:
            raise InvalidAdapterError(f"adapter {name!r}: {field} must be a positive number (and finite), "
                                      f"got {value!r}")
    warn_if_other_base("adapter", name, config.get("base_model_name_or_path"), spec.model_name)


def _targeted_ranks(name: str, config: dict, spec: ModelSpec, max_lora_rank: int) -> dict[str, tuple[int, float]]:
    """module key -> (rank, scaling) for every module the config targets; checks ranks before any read."""
    targeted, targets = {}, PeftTargets.from_config(name, config)  # every pattern runs in RE2
    for key in _candidate_modules(spec):
        if not targets.is_targeted(key):
            continue
        if key in VOCAB_MODULES:
            check_vocab_target(name, key, config, spec)
        rank, alpha = targets.rank(key, config["r"]), targets.alpha(key, None)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise InvalidAdapterError(f"adapter {name!r}: rank of {key} must be a positive int, got {rank!r}")
        if rank > max_lora_rank:
            raise AdapterTooLargeError(f"adapter {name!r}: {key} has rank {rank}, over max_lora_rank="
                                       f"{max_lora_rank}")
        field = "lora_alpha" if alpha is None else "alpha_pattern"
        alpha = config["lora_alpha"] if alpha is None else alpha
        targeted[key] = (rank, _checked_scaling(name, key, field, alpha, rank, bool(config.get("use_rslora"))))
    if not targeted:
        raise InvalidAdapterError(f"adapter {name!r}: target_modules={config['target_modules']!r} matches no "
                                  f"module of this model; supported: {_supported_text(spec)}")
    return targeted


def _is_finite_number(value) -> bool:
    """A real number (not a bool) that is finite as a float (huge ints and NaN/Infinity are not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _checked_scaling(name: str, key: str, field: str, alpha, rank: int, use_rslora: bool) -> float:
    """alpha / r (alpha / sqrt(r) with rsLoRA), refused unless finite in float32, the dtype of the slot
    scales the kernels apply it in (adapters.slots): a 1e40 written there would overflow inside the step."""
    if not _is_finite_number(alpha):
        raise InvalidAdapterError(f"adapter {name!r}: {field} of {key} must be a finite number, got {alpha!r}")
    scaling = float(alpha) / (math.sqrt(rank) if use_rslora else rank)
    if not abs(scaling) <= FLOAT32_MAX:
        raise InvalidAdapterError(f"adapter {name!r}: {field}={alpha!r} gives {key} a scaling of {scaling:g}, "
                                  f"which overflows float32 (at most {FLOAT32_MAX:g})")
    return scaling


def _group_keys(name: str, tensors: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, dict[str, torch.Tensor]]:
    """module key -> {"lora_A": tensor, "lora_B": tensor}, refusing keys of unsupported features."""
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY_RE.match(key)
        parts = ((match.group("module"), match.group("ab") or match.group("magnitude")) if match
                 else vocab_key_parts(key))
        if parts is None:
            feature = ("this DoRA weight (lora_magnitude_vector)" if "lora_magnitude_vector" in key else
                       "LoRA on embeddings" if "lora_embedding" in key else
                       "a bias on lora_B" if key.endswith("lora_B.bias") else "this weight")
            raise UnsupportedAdapterError(f"adapter {name!r}: key {key!r}: {feature} is not supported; "
                                          f"supported: {_supported_text(spec)}")
        module, ab = parts
        if ab in grouped.setdefault(module, {}):
            raise InvalidAdapterError(f"adapter {name!r}: duplicate weights for {module}.{ab}")
        grouped[module][ab] = tensor
    return grouped


def _checked_factor(name: str, key: str, tensor: torch.Tensor, shape: tuple[int, int], scaling: float,
                    dtype: torch.dtype, share: bool = False) -> torch.Tensor:
    """Shape/dtype/finiteness checks; returns ``tensor * scaling`` cast to ``dtype`` (with ``share``,
    ``tensor`` itself when that is it bit for bit: scaling 1, the same dtype, contiguous)."""
    if tuple(tensor.shape) != shape:
        raise InvalidAdapterError(f"adapter {name!r}: {key} has shape {tuple(tensor.shape)}, expected {shape} "
                                  "for this base model (adapter trained on a different model?)")
    if not tensor.is_floating_point():
        raise InvalidAdapterError(f"adapter {name!r}: {key} has dtype {tensor.dtype}; floating point expected")
    if share and scaling == 1.0 and tensor.dtype == dtype and tensor.is_contiguous():
        out = tensor  # an immutable snapshot (adapters.memory_source): not held twice
    else:
        out = (tensor.float() * scaling).to(dtype).contiguous()
    low, high = out.aminmax()  # one pass; NaN propagates into both, inf shows in one
    if not (torch.isfinite(low) and torch.isfinite(high)):
        if not torch.isfinite(tensor).all():
            raise InvalidAdapterError(f"adapter {name!r}: {key} contains NaN or inf")
        raise InvalidAdapterError(f"adapter {name!r}: {key} (scaled by {scaling:g}) overflows {dtype}")
    return out


def _untargeted_module_error(name: str, module: str, config: dict, spec: ModelSpec) -> Exception:
    """The error for weights of a module the config does not target (or this model does not have)."""
    if module not in VOCAB_MODULES and module not in spec.peft_targets():
        pattern, layer = _layer_free(module)
        known = {_layer_free(path)[0] for path in spec.peft_targets()}
        if layer is not None and layer >= spec.num_layers and pattern in known:
            return InvalidAdapterError(f"adapter {name!r}: weights for {module}, but the base model has only "
                                       f"{spec.num_layers} layers (adapter trained on a different model?)")
        return UnsupportedAdapterError(f"adapter {name!r}: weights for {module} are not supported; "
                                       f"supported: {_supported_text(spec)}")
    return InvalidAdapterError(f"adapter {name!r}: weights for {module}, which adapter_config.json does not "
                               f"target (target_modules={config['target_modules']!r})")


def _slice_rows(module: LoRAModule, indices: tuple[int, ...], b: torch.Tensor) -> list[torch.Tensor]:
    """B's rows of each slice: a fused module's B (Phi-3 qkv_proj / gate_up_proj) holds the slices' rows
    in slot order, so slice j's delta is (x @ A.T) @ B[rows_j].T exactly, with A shared by the slices."""
    if len(indices) == 1:
        return [b]
    sizes = [module.slice_sizes[i] for i in indices]
    return [rows.contiguous() for rows in b.split(sizes)]


def parse_lora(name: str, config: dict, tensors: dict[str, torch.Tensor], spec: ModelSpec, *,
               max_lora_rank: int, dtype: torch.dtype = torch.float32,
               base_weight: BaseWeight | None = None, share_storage: bool = False) -> LoRAWeights:
    """Validate a PEFT LoRA (config + state dict) against ``spec`` and convert it to :class:`LoRAWeights`.

    ``share_storage``: factors already in ``dtype`` (and contiguous) are used as they are, not copied;
    only for tensors nobody changes afterwards (an in-memory adapter's snapshot).

    ``base_weight`` (layer, module name) -> base weight [N, K] is needed for DoRA only: its column scales
    are computed from it (on its device) once everything else has been validated.

    Raises:
        UnsupportedAdapterError: a feature this engine does not run (see module docstring).
        AdapterTooLargeError: a module's rank exceeds ``max_lora_rank``.
        InvalidAdapterError: bad config, missing/extra keys, wrong shapes, non-float or non-finite weights.
    """
    config, tensors = unstack_parameters(name, config, tensors, spec)  # target_parameters: per-module LoRA
    _check_config(name, config, spec)
    targeted = _targeted_ranks(name, config, spec, max_lora_rank)
    use_dora = _check_dora(name, config, targeted, spec, base_weight)
    grouped = _group_keys(name, tensors, spec)
    extra = sorted(set(grouped) - set(targeted))
    if extra:
        raise _untargeted_module_error(name, extra[0], config, spec)
    modules: dict[tuple[int, str], list[LoRAPair | None]] = {}
    vocab: dict[str, LoRAPair] = {}
    targets = spec.peft_targets()
    for key, (rank, scaling) in targeted.items():
        factors = grouped.get(key, {})
        for ab in ("lora_A", "lora_B"):
            if ab not in factors:
                raise InvalidAdapterError(f"adapter {name!r}: missing key base_model.model.{key}.{ab}.weight")
        target = targets.get(key)
        shape_a, shape_b = (vocab_factor_shapes(name, key, factors, rank, spec) if target is None
                            else target[0].peft_shapes(target[1], rank))
        a = _checked_factor(name, f"{key}.lora_A", factors["lora_A"], shape_a, 1.0, dtype, share_storage)  # [r, K]
        b = _checked_factor(name, f"{key}.lora_B", factors["lora_B"], shape_b, 1.0, dtype, share_storage)  # [N_j, r]
        if target is None:
            vocab[VOCAB_MODULES[key]] = LoRAPair(a, b, scaling)
            continue
        _check_magnitude(name, key, factors, shape_b[0], use_dora)
        module, indices = target
        slices = modules.setdefault(module.key, [None] * len(module.slice_sizes))
        for index, rows in zip(indices, _slice_rows(module, indices, b)):
            slices[index] = LoRAPair(a, rows, scaling)
    if use_dora:
        _add_dora_scales(name, modules, grouped, targets, base_weight)
    rank = max(r for r, _ in targeted.values())
    return LoRAWeights(name, rank, {k: tuple(v) for k, v in sorted(modules.items())}, vocab)


def load_lora(name: str, local_dir: str | AdapterDir, spec: ModelSpec, *, max_lora_rank: int,
              dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
              max_bytes: int | None = None, base_weight: BaseWeight | None = None) -> LoRAWeights:
    """Read and validate the PEFT LoRA in ``local_dir``; the config is checked before the weights are read.

    ``local_dir``: a path, or a directory held open (adapters.files; a tenant's is confined); both
    files are read beneath the one directory descriptor. ``base_weight``: as in :func:`parse_lora` (DoRA only).
    """
    with held_dir(local_dir) as directory:
        config = read_adapter_config(name, directory, max_bytes)
        checked = unstack_config(name, config, spec)
        _check_config(name, checked, spec)
        _check_dora(name, checked, _targeted_ranks(name, checked, spec, max_lora_rank), spec, base_weight)
        tensors = read_adapter_tensors(name, directory, allow_pickle=allow_pickle, max_bytes=max_bytes)
    return parse_lora(name, config, tensors, spec, max_lora_rank=max_lora_rank, dtype=dtype,
                      base_weight=base_weight)


def dummy_lora(name: str, spec: ModelSpec, rank: int, dtype: torch.dtype = torch.float32,
               scale: float = 0.01, seed: int = 0) -> LoRAWeights:
    """An adapter of the right shapes on every LoRA-capable module (small random values; no file)."""
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for module in spec.modules:
        modules[module.key] = tuple(
            LoRAPair((torch.randn(rank, module.in_features, generator=gen) * scale).to(dtype),  # [r, K]
                     (torch.randn(n, rank, generator=gen) * scale).to(dtype))  # [N_j, r]
            for n in module.slice_sizes)
    return LoRAWeights(name, rank, modules)


# ------------------------------------------------------------------ DoRA (adapters.dora)

def _check_dora(name: str, config: dict, targeted: dict, spec: ModelSpec, base_weight: BaseWeight | None) -> bool:
    """Whether the adapter is DoRA; refuses DoRA where it cannot be served: anywhere but a PEFT module
    covering one slice of a LoRA-capable module (its norms are per row of that slice's base weight)."""
    use_dora = config.get("use_dora")
    if use_dora not in (None, False, True):
        raise InvalidAdapterError(f"adapter {name!r}: use_dora must be true or false, got {use_dora!r}")
    if not use_dora:
        return False
    targets = spec.peft_targets()
    for key in targeted:
        if key not in targets or len(targets[key][1]) != 1 or not targets[key][0].dora:
            raise UnsupportedAdapterError(f"adapter {name!r}: DoRA on {key} is not supported; DoRA is served on "
                                          f"{_supported_text(spec, dora=True)}")
    if base_weight is None:
        raise UnsupportedAdapterError(f"adapter {name!r}: DoRA (use_dora=True) needs the base model's weights "
                                      "to compute its weight norms: load it through an engine (AdapterManager("
                                      "base_weight=...)) or pass base_weight")
    return True


def _check_magnitude(name: str, key: str, factors: dict, out_features: int, use_dora: bool) -> None:
    magnitude = factors.get("lora_magnitude_vector")
    if not use_dora:
        if magnitude is not None:
            raise InvalidAdapterError(f"adapter {name!r}: {key}.lora_magnitude_vector (DoRA) is present but "
                                      "adapter_config.json does not set use_dora")
        return
    if magnitude is None:
        raise InvalidAdapterError(f"adapter {name!r}: use_dora is set but base_model.model.{key}."
                                  "lora_magnitude_vector is missing")
    if tuple(magnitude.shape) != (out_features,) or not magnitude.is_floating_point():
        raise InvalidAdapterError(f"adapter {name!r}: {key}.lora_magnitude_vector has shape "
                                  f"{tuple(magnitude.shape)} and dtype {magnitude.dtype}; expected a float vector of "
                                  f"{out_features} (adapter trained on a different model?)")
    if not torch.isfinite(magnitude).all():
        raise InvalidAdapterError(f"adapter {name!r}: {key}.lora_magnitude_vector contains NaN or inf")


def _add_dora_scales(name: str, modules: dict, grouped: dict, targets: dict, base_weight: BaseWeight) -> None:
    """Fill each DoRA slice's column scale (one slice's merged weight at a time, on the base's device)."""
    for key, factors in grouped.items():
        module, (index,) = targets[key]  # one slice each (_check_dora)
        weight = base_weight(module.layer, module.name)  # [N, K]
        assert tuple(weight.shape) == (module.out_features, module.in_features), f"base weight of {key}: {weight.shape}"
        offset, rows = module.slice_offsets[index], module.slice_sizes[index]
        pair = modules[module.key][index]
        scale = dora_column_scale(weight[offset:offset + rows], factors["lora_A"], factors["lora_B"],
                                  pair.scaling, factors["lora_magnitude_vector"])  # [N_j]
        if not torch.isfinite(scale).all():
            raise InvalidAdapterError(f"adapter {name!r}: {key}: a row of the merged weight W + scaling * B @ A has "
                                      "norm 0 (or overflows), so DoRA's scale is not finite")
        modules[module.key][index] = pair._replace(column_scale=scale)
