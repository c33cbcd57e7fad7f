"""Building blocks of the decoder: RMSNorm, rotary embedding (with rope scaling); the LoRA-aware
linear is lora_runner.model.lora_linear's (re-exported here).

Numerics follow transformers' Llama implementation so fp32 logits agree to ~1e-5: RMSNorm in fp32,
cos/sin computed in fp32 then cast to the activation dtype, rotate-half RoPE.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_runner.model.config import RopeConfig
from lora_runner.model.lora_linear import LoRALinear, lora_base_weights
from punica_kernels import invariant

__all__ = ["LoRALinear", "RMSNorm", "RotaryEmbedding", "lora_base_weights", "rope_inv_freq"]


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in fp32 and cast back before the weight.

    unit_offset (Gemma): y = x / sqrt(mean(x^2) + eps) * (1 + w), all in fp32, cast at the end.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device | str,
                 unit_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and invariant.enabled():  # torch's mean on CUDA sums a row in an order set by the row count
            return invariant.rms_norm(x, self.weight, self.eps, self.unit_offset)
        x32 = x.float()  # [..., hidden]
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)


def _dynamic_inv_freq(theta: float, dim: int, factor: float, max_pos: int, seq_lens: torch.Tensor) -> torch.Tensor:
    """Dynamic-NTK inverse frequencies per token from its sequence's length: [T] -> [T, dim/2]."""
    seq_lens = seq_lens.float().clamp(min=max_pos)  # [T]; no change up to max_pos
    base = theta * ((factor * seq_lens / max_pos) - (factor - 1)) ** (dim / (dim - 2))  # [T]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_lens.device).float() / dim
    return 1.0 / (base[:, None] ** exponents[None, :])  # [T, dim/2]


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim/2] fp32, attention scaling of cos/sin) as transformers computes them.

    For 'dynamic' this is the unscaled table; per-token frequencies come from `_dynamic_inv_freq`.
    """
    dim = head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    inv_freq = 1.0 / (rope.theta ** exponents)  # [dim/2]
    scaling = rope.scaling or {}
    rope_type = rope.rope_type
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rope.theta, dim, scaling, max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(rope.theta, dim, scaling, max_position_embeddings, "short_factor")
    return inv_freq, 1.0  # default, dynamic


def _longrope_inv_freq(theta: float, dim: int, scaling: dict, max_position_embeddings: int,
                       which: str) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, `which` = "short_factor" (contexts up to the original
    length) or "long_factor" (beyond it); the attention factor is the same for both."""
    factors = scaling[which]
    if not isinstance(factors, (list, tuple)) or len(factors) != dim // 2:
        raise ValueError(f"longrope {which} must be a list of head_dim/2 = {dim // 2} numbers, got {factors!r:.80}")
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [dim/2]
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents), float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [dim/2]
    # long wavelengths are interpolated by `factor`, short ones kept, the band between smoothly blended
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, blended, scaled)


def _yarn_inv_freq(theta: float, dim: int, scaling: dict, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    factor = scaling.get("factor") or max_position_embeddings / scaling["original_max_position_embeddings"]
    original = scaling["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with transformers' scaling schemes (default, linear, dynamic, llama3, yarn, longrope).

    'dynamic' (NTK) picks each token's base from its own sequence's length, and 'longrope' its short or
    long factors (long once the sequence is longer than original_max_position_embeddings), which is
    what transformers does for one sequence generated with a KV cache (keys keep the rotation they
    were written with).
    """

    PER_SEQUENCE_TYPES = ("dynamic", "longrope")  # rope types whose frequencies depend on the sequence length

    def __init__(self, head_dim: int, max_position_embeddings: int, rope: RopeConfig, device):
        super().__init__()
        inv_freq, self.attention_scaling = rope_inv_freq(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # [head_dim/2] fp32
        if rope.rope_type == "longrope":
            long_inv_freq, _ = _longrope_inv_freq(rope.theta, head_dim, rope.scaling, max_position_embeddings,
                                                  "long_factor")
            self.register_buffer("long_inv_freq", long_inv_freq.to(device), persistent=False)  # [head_dim/2]
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.rope = rope

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype,
                token_seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] in `dtype` for positions [T]; token_seq_lens [T] only for PER_SEQUENCE_TYPES."""
        if self.rope.rope_type == "dynamic" and token_seq_lens is not None:
            inv_freq = _dynamic_inv_freq(self.rope.theta, self.head_dim, self.rope.scaling["factor"],
                                         self.max_position_embeddings, token_seq_lens)  # [T, dim/2]
            freqs = positions[:, None].float() * inv_freq  # [T, dim/2]
        elif self.rope.rope_type == "longrope" and token_seq_lens is not None:
            is_long = token_seq_lens[:, None] > self.rope.scaling["original_max_position_embeddings"]  # [T, 1]
            inv_freq = torch.where(is_long, self.long_inv_freq[None, :], self.inv_freq[None, :])  # [T, dim/2]
            freqs = positions[:, None].float() * inv_freq  # [T, dim/2]
        else:
            freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, head_dim] by cos/sin [T, head_dim]."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, heads, head_dim]
        return x * cos[:, None, :] + rotated * sin[:, None, :]
