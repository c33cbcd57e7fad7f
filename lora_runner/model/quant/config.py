"""Which quantization a base model uses: ``quantization_config`` in its config.json (compressed-tensors,
GPTQ, AWQ) or the engine's ``quantization="fp8"`` (a float checkpoint quantized at load).

Everything is checked here, before any weight is allocated: a config (or a field of one) this code does
not implement is a ValueError naming the field, never a checkpoint whose scales are silently ignored.
The 4-bit formats are parsed by their own modules (``lora_runner.model.quant.gptq`` / ``awq`` /
``ct_int4``: ``parse_config(qcfg) -> Int4Format``); FP8 by ``lora_runner.model.quant.fp8``. A
compressed-tensors ``ignore`` list must name lm_head; its other entries may name only linears the model
reads unquantized anyway (an MoE block's router and shared expert gate: :meth:`QuantConfig.check_ignore`,
which ModelConfig calls with the model's module names).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from lora_runner.model.quant.fp8 import Fp8Format
from lora_runner.model.quant.fp8 import parse_config as parse_ct_fp8
from lora_runner.model.quant.int4_layout import Int4Format

ONLINE_METHODS = ("fp8",)  # EngineConfig.quantization values
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")  # quantization_config.quant_method values
INT4_MODULES = {"gptq": "gptq", "awq": "awq", "compressed-tensors": "ct_int4"}
WHERE = "quantization_config"

# compressed-tensors top-level fields: those that must be empty (features this code does not implement)
_CT_EMPTY = ("kv_cache_scheme", "sparsity_config", "transform_config", "moe_sparsity_config")
_CT_KNOWN = ("config_groups", "format", "global_compression_ratio", "ignore", "quant_method", "quantization_status",
             "version", *_CT_EMPTY)
_CT_FORMATS = {8: ("float-quantized", "naive-quantized"), 4: ("pack-quantized",)}
_LM_HEAD_NAMES = ("lm_head", "re:.*lm_head", "re:^lm_head$")


@dataclass(frozen=True)
class QuantConfig:
    """The quantization of every linear layer of the decoder (embeddings and lm_head stay unquantized).

    ``kind`` "fp8" (``fp8`` set) or "int4" (``int4`` set, W4A16); ``source`` where it came from:
    "compressed-tensors", "gptq", "awq" or "online". ``ignore``: the compressed-tensors ``ignore`` entries
    besides lm_head's (module names or "re:" patterns the checkpoint left unquantized), which
    :meth:`check_ignore` holds against the model's linears.
    """

    kind: str
    source: str
    fp8: Fp8Format | None = None
    int4: Int4Format | None = None
    ignore: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        assert (self.kind == "fp8") == (self.fp8 is not None) and (self.kind == "int4") == (self.int4 is not None), \
            f"QuantConfig {self.kind!r} with fp8={self.fp8!r}, int4={self.int4!r}"

    def check_in_features(self, in_features: dict[str, int]) -> None:
        """ValueError when a 4-bit group size does not divide a linear's input width ({packed: K})."""
        if self.int4 is None:
            return
        group = self.int4.group_size
        for packed, k in in_features.items():
            if k % group or k % 8:
                raise ValueError(f"{WHERE}.group_size {group} does not divide the input width {k} of the {packed} "
                                 "projection (and 4-bit weights pack 8 columns per word)")

    def check_ignore(self, quantized: Iterable[str]) -> None:
        """ValueError naming the ``ignore`` entry that leaves out one of ``quantized`` (the checkpoint module
        paths of the linears the model reads quantized): reading one of those unquantized is not
        implemented. Entries that match only linears the model reads unquantized anyway (an MoE block's
        router and shared expert gate), or none of its linears, pass: they leave nothing out. An entry
        matches as compressed-tensors matches it: equal to the path, or "re:" and ``re.match``."""
        paths = list(quantized)
        for entry in self.ignore:
            matches = _ignore_matcher(entry)
            left_out = [path for path in paths if matches(path)]
            if left_out:
                raise ValueError(f"{WHERE}.ignore entry {entry!r} leaves {left_out[0]} unquantized"
                                 f"{f' (and {len(left_out) - 1} more)' if len(left_out) > 1 else ''}: reading a "
                                 "decoder linear unquantized is not implemented (only lm_head and a "
                                 "mixture-of-experts block's router and shared expert gate may be ignored)")


def parse_quantization(raw: dict[str, Any], quantization: str | None = None) -> QuantConfig | None:
    """The QuantConfig of a parsed config.json and the engine's ``quantization`` option (None: none).

    ValueError for an unknown option, an option given for an already quantized checkpoint, and any
    ``quantization_config`` (or field of one) this code does not implement, naming the field.
    """
    qcfg = raw.get(WHERE)
    if quantization is not None and quantization not in ONLINE_METHODS:
        raise ValueError(f"quantization must be None or one of {ONLINE_METHODS}, got {quantization!r}")
    if qcfg is None:
        if quantization == "fp8":
            return QuantConfig("fp8", "online", fp8=Fp8Format(online=True, dynamic_activations=True))
        return None
    if quantization is not None:
        raise ValueError(f"quantization={quantization!r} quantizes a float checkpoint at load; this one is already "
                         f"quantized ({WHERE}.quant_method {qcfg.get('quant_method')!r}): leave quantization unset")
    if not isinstance(qcfg, dict):
        raise ValueError(f"{WHERE} must be a JSON object, got {type(qcfg).__name__}")
    method = qcfg.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(qcfg)
    if method in ("gptq", "awq"):
        bits = qcfg.get("bits", qcfg.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{WHERE}.bits = {bits!r} is not implemented for {method} (supported: 4)")
        if qcfg.get("lm_head"):
            raise ValueError(f"{WHERE}.lm_head = true (a quantized lm_head) is not implemented")
        return QuantConfig("int4", method, int4=_int4_format(method, qcfg))
    raise ValueError(f"{WHERE}.quant_method {method!r} is not implemented (supported: {', '.join(CHECKPOINT_METHODS)}"
                     " checkpoints, or quantization='fp8' on a float checkpoint)")


def _compressed_tensors(qcfg: dict[str, Any]) -> QuantConfig:
    for key, value in qcfg.items():
        if key not in _CT_KNOWN and value not in (None, {}, []):
            raise ValueError(f"{WHERE}.{key} is not implemented (value {value!r:.80})")
    for key in _CT_EMPTY:
        if qcfg.get(key):
            raise ValueError(f"{WHERE}.{key} is not implemented (value {qcfg[key]!r:.80})")
    if qcfg.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"{WHERE}.quantization_status {qcfg['quantization_status']!r}: only compressed "
                         "checkpoints are read")
    ignore = qcfg.get("ignore") or []
    if not any(name in _LM_HEAD_NAMES for name in ignore):
        raise ValueError(f"{WHERE}.ignore must name lm_head: a quantized lm_head is not implemented")
    # the rest (an MoE router's, say) is held against the model's linears by QuantConfig.check_ignore
    others = tuple(name for name in ignore if name not in _LM_HEAD_NAMES)
    groups = qcfg.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{WHERE}.config_groups has {len(groups)} groups; one scheme for every Linear is "
                         "implemented")
    (group_name, scheme), = groups.items()
    where = f"{WHERE}.config_groups.{group_name}"
    if scheme.get("targets") != ["Linear"]:
        raise ValueError(f"{where}.targets {scheme.get('targets')!r}: only ['Linear'] is implemented")
    if scheme.get("output_activations") is not None:
        raise ValueError(f"{where}.output_activations is not implemented")
    weights = scheme.get("weights")
    if not isinstance(weights, dict):
        raise ValueError(f"{where}.weights is missing")
    bits = weights.get("num_bits")
    if bits not in _CT_FORMATS:
        raise ValueError(f"{where}.weights.num_bits = {bits!r} is not implemented (supported: 8 float, 4 int)")
    form = scheme.get("format") or qcfg.get("format")
    if form not in _CT_FORMATS[bits]:
        raise ValueError(f"{where}.format {form!r} is not implemented for {bits}-bit weights (supported: "
                         f"{', '.join(_CT_FORMATS[bits])})")
    if bits == 8:
        if weights.get("type") != "float":
            raise ValueError(f"{where}.weights.type {weights.get('type')!r} is not implemented for 8 bits "
                             "(supported: 'float', FP8)")
        return QuantConfig("fp8", "compressed-tensors", fp8=parse_ct_fp8(scheme, where), ignore=others)
    if scheme.get("input_activations") is not None:
        raise ValueError(f"{where}.input_activations is not implemented with 4-bit weights (W4A16 only)")
    return QuantConfig("int4", "compressed-tensors", int4=_int4_format("compressed-tensors", qcfg), ignore=others)


def _ignore_matcher(entry: str) -> Callable[[str], bool]:
    """Whether a compressed-tensors ``ignore`` entry names a module path, as compressed_tensors.utils.match_name
    decides: equal to it, or "re:" and ``re.match``. ValueError for a pattern that does not compile."""
    if not entry.startswith("re:"):
        return lambda path: path == entry
    try:
        pattern = re.compile(entry[3:])
    except re.error as err:
        raise ValueError(f"{WHERE}.ignore entry {entry!r} is not a regular expression: {err}") from err
    return lambda path: pattern.match(path) is not None


def _int4_format(method: str, qcfg: dict[str, Any]) -> Int4Format:
    """The 4-bit format module's ``parse_config(qcfg)`` (ValueError naming the field it refuses)."""
    module_name = f"lora_runner.model.quant.{INT4_MODULES[method]}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise ValueError(f"{WHERE}.quant_method {method!r}: 4-bit {method} checkpoints need {module_name}, which "
                         "this installation lacks") from err
    return module.parse_config(qcfg)
