"""What differs between the supported decoder families, read from their ``config.json``.

Every family runs as the Llama decoder with options (fields of ModelConfig); this module maps each
architecture's config keys onto those options and refuses what is not implemented:

* Llama, Mistral, Qwen2: biases (Llama ``attention_bias`` / ``mlp_bias``, Qwen2's q/k/v bias) and
  sliding windows (Mistral: every layer; Qwen2: the layers ``layer_types`` marks, with
  ``use_sliding_window``).
* Qwen3: RMSNorm over each head's ``head_dim`` on q and k before RoPE (``q_norm`` / ``k_norm``);
  ``head_dim`` from the config; Qwen2's sliding-window rules.
* Gemma 2: RMSNorm applied as ``(1 + w)``, GeGLU (``gelu_pytorch_tanh``), embeddings scaled by
  ``sqrt(hidden)`` in the model dtype, attention and final logit soft-capping
  (``cap * tanh(x / cap)``), ``query_pre_attn_scalar ** -0.5`` as the softmax scale, sliding-window
  layers from ``layer_types`` (default: even layers slide), and norms before and after both the
  attention and the feed-forward block.
* Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` in checkpoints and adapters, a sliding window on every
  layer, and LongRoPE ("longrope"; old configs say "su" or "yarn" for it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = tuple(MODEL_TYPES.values())
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")  # SwiGLU; GeGLU with the tanh approximation of GELU


def family_options(architecture: str, raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments specific to `architecture`, read from a config.json dict.

    Raises ValueError for a family option this engine does not implement.
    """
    return _FAMILIES[architecture](raw)


def _windowed_layers(raw: dict[str, Any], num_layers: int, default_sliding: Callable[[int], bool]) -> tuple:
    """Per-layer windows from ``layer_types`` (or `default_sliding(layer)` without it); () = none."""
    window = raw.get("sliding_window")
    if window is None:
        return ()
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if default_sliding(i) else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"unsupported layer_types {unknown}; supported: sliding_attention, full_attention")
    windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    return windows if any(w is not None for w in windows) else ()


def _qwen_windows(raw: dict[str, Any]) -> tuple:
    # Qwen2/Qwen3: windows only with use_sliding_window, on layers i >= max_window_layers by default
    if not raw.get("use_sliding_window", False):
        return ()
    first = raw.get("max_window_layers", 28)
    return _windowed_layers(raw, raw["num_hidden_layers"], lambda i: i >= first)


def _silu_only(raw: dict[str, Any], key: str = "hidden_act") -> str:
    act = raw.get(key, "silu")
    if act != "silu":
        raise ValueError(f"unsupported {key} {act!r}; only 'silu' is implemented for this architecture")
    return act


def _llama(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(hidden_act=_silu_only(raw), qkv_bias=bias, o_bias=bias, mlp_bias=bool(raw.get("mlp_bias", False)))


def _mistral(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return dict(hidden_act=_silu_only(raw), sliding_windows=() if window is None else
                (window,) * raw["num_hidden_layers"])


def _qwen2(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(hidden_act=_silu_only(raw), qkv_bias=True, sliding_windows=_qwen_windows(raw))


def _qwen3(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return dict(hidden_act=_silu_only(raw), qkv_bias=bias, o_bias=bias, qk_norm=True,
                sliding_windows=_qwen_windows(raw))


def _gemma2(raw: dict[str, Any]) -> dict[str, Any]:
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 2; only 'gelu_pytorch_tanh'")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported: the engine serves causal decoders only")
    bias = bool(raw.get("attention_bias", False))
    return dict(
        hidden_act=act, qkv_bias=bias, o_bias=bias, norm_unit_offset=True, sandwich_norms=True,
        embedding_scale=math.sqrt(raw["hidden_size"]), query_pre_attn_scalar=raw.get("query_pre_attn_scalar", 256),
        attn_logit_softcap=raw.get("attn_logit_softcapping"), final_logit_softcap=raw.get("final_logit_softcapping"),
        sliding_windows=_windowed_layers(raw, raw["num_hidden_layers"], lambda i: i % 2 == 0))


def _phi3(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return dict(hidden_act=_silu_only(raw), fused_projections=True,
                sliding_windows=() if window is None else (window,) * raw["num_hidden_layers"])


_FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama, "MistralForCausalLM": _mistral, "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3, "Gemma2ForCausalLM": _gemma2, "Phi3ForCausalLM": _phi3,
}
assert set(_FAMILIES) == set(SUPPORTED_ARCHITECTURES)


def rope_type_alias(architecture: str, rope_type: str) -> str:
    """transformers' Phi-3 reads the older names "su" and "yarn" as LongRoPE."""
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        return "longrope"
    return rope_type
