"""FP8 base weights: the in-memory layout, online quantization of a bf16/fp16/fp32 checkpoint, and the
compressed-tensors FP8 checkpoint format (``float-quantized``: per-channel or per-tensor weight scales).

Layout of one linear layer y = x @ W.T with W [N, K]:

- ``weight`` torch.float8_e4m3fn [N, K];
- ``weight_scale`` float32 [N] (per output channel; a per-tensor scale is broadcast to [N]);

W = weight.float() * weight_scale[:, None]. Slices of a packed projection (q, k, v -> qkv) concatenate
along N, each with its own scales.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
_MIN_SCALE = 1e-12  # an all-zero row gets this scale instead of 0 (its values stay 0)


RowMax = Callable[[torch.Tensor], torch.Tensor]  # [N] float32 row maxima of a shard -> of the whole row, in place


def quantize_per_channel(weight: torch.Tensor, row_max: RowMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] (any float dtype) -> (fp8 weight [N, K], float32 scale [N]) with scale = max|W[n]| / 448,
    computed in float32 (as vLLM's online FP8, per output channel).

    ``row_max`` (a row-parallel shard holding some of each row's columns): the maximum over the whole
    row from this shard's (an all-reduce of the maxima), so every rank quantizes as one rank would."""
    w32 = weight.float()  # [N, K]
    amax = w32.abs().amax(dim=1)  # [N]
    if row_max is not None:
        amax = row_max(amax)
    scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)  # [N]
    quantized = (w32 / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)  # [N, K]
    return quantized, scale


def dequantize(weight: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` from fp8 weight [N, K] and scale [N] (float32 math, float64 when asked)."""
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(compute) * weight_scale.to(compute)[:, None]).to(dtype)


@dataclass(frozen=True)
class Fp8Format:
    """How FP8 weights arrive: quantized in the checkpoint (compressed-tensors, ``weight`` +
    ``weight_scale``) or quantized here from a float checkpoint (``online``: ``weight`` only).

    ``dynamic_activations``: the scheme quantizes each token's activations to FP8 (W8A8); the CUDA
    kernel does that, the CPU path multiplies by the dequantized weight either way.
    """

    online: bool
    dynamic_activations: bool

    @property
    def suffixes(self) -> tuple[str, ...]:
        """Tensor-name suffixes of one linear layer in the checkpoint."""
        return ("weight",) if self.online else ("weight", "weight_scale")

    def convert(self, tensors: dict[str, torch.Tensor], in_features: int, out_features: int,
                name: str = "", row_max: RowMax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One slice's checkpoint tensors -> (fp8 weight [N, K], float32 scale [N]); ValueError naming
        the tensor when a shape or dtype does not fit. row_max: see quantize_per_channel (online only)."""
        weight = tensors["weight"]
        if tuple(weight.shape) != (out_features, in_features):
            raise ValueError(f"checkpoint tensor {name}.weight has shape {tuple(weight.shape)}, "
                             f"the model expects {(out_features, in_features)}")
        if self.online:
            if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
                raise ValueError(f"quantization='fp8' quantizes a float checkpoint; {name}.weight is {weight.dtype}")
            return quantize_per_channel(weight, row_max)
        if weight.dtype != FP8_DTYPE:
            raise ValueError(f"checkpoint tensor {name}.weight is {weight.dtype}; the FP8 scheme in "
                             f"quantization_config needs {FP8_DTYPE}")
        scale = tensors["weight_scale"]
        if not scale.is_floating_point() or scale.numel() not in (1, out_features):
            raise ValueError(f"checkpoint tensor {name}.weight_scale has shape {tuple(scale.shape)} "
                             f"({scale.dtype}); expected one float per output channel ({out_features}) or one "
                             "per tensor")
        scale = scale.float().reshape(-1).expand(out_features).contiguous()  # [N]
        if not torch.isfinite(scale).all() or (scale <= 0).any():
            raise ValueError(f"checkpoint tensor {name}.weight_scale holds non-positive or non-finite scales")
        return weight, scale


# QuantizationArgs of compressed-tensors' FP8 weights (its FP8 / FP8_DYNAMIC presets): value each field must
# have, None meaning "any" (observer settings only matter when the checkpoint was made)
_CT_WEIGHT_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                   "block_structure": None, "actorder": None, "scale_dtype": None}
_CT_ACTIVATION_ARGS = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token",
                       "group_size": None, "block_structure": None, "actorder": None, "scale_dtype": None}
_IGNORED_ARGS = ("observer", "observer_kwargs", "zp_dtype")


def parse_config(scheme: dict, where: str) -> Fp8Format:
    """A compressed-tensors FP8 config group (``weights`` channel or tensor strategy, ``input_activations``
    None or dynamic per token) -> Fp8Format; ValueError naming the first field (``where`` + path) this
    code does not implement."""
    weights = scheme.get("weights") or {}
    _check_args(weights, _CT_WEIGHT_ARGS, f"{where}.weights")
    if weights.get("strategy") not in ("channel", "tensor"):
        raise ValueError(f"{where}.weights.strategy {weights.get('strategy')!r} is not implemented for FP8 "
                         "(supported: 'channel', 'tensor')")
    activations = scheme.get("input_activations")
    if activations is not None:
        _check_args(activations, _CT_ACTIVATION_ARGS, f"{where}.input_activations")
    return Fp8Format(online=False, dynamic_activations=activations is not None)


def _check_args(args: dict, expected: dict, where: str) -> None:
    for key, value in args.items():
        if key in _IGNORED_ARGS:
            continue
        if key not in expected and key != "strategy":
            raise ValueError(f"{where}.{key} is not implemented (value {value!r})")
        if key in expected and value != expected[key] and not (expected[key] is None and not value):
            raise ValueError(f"{where}.{key} = {value!r} is not implemented for FP8 (supported: {expected[key]!r})")
    for key, value in expected.items():
        if value is not None and key not in args and key != "symmetric":
            raise ValueError(f"{where}.{key} is missing (expected {value!r})")
