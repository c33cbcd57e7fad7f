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
* Mixtral and Qwen3-MoE: Mistral's / Qwen3's attention, and a sparse mixture of experts in place of the
  MLP (lora_runner/model/moe.py): ``num_local_experts`` (Qwen3-MoE: ``num_experts``) SwiGLU experts of
  ``moe_intermediate_size`` (Mixtral: ``intermediate_size``) rows, top-``num_experts_per_tok``
  routing, renormalised always (Mixtral) or with ``norm_topk_prob`` (Qwen3-MoE); Qwen3-MoE's dense
  layers (``mlp_only_layers``, ``decoder_sparse_step``) keep the dense MLP of ``intermediate_size``.
* Qwen2-MoE: Qwen2's attention (q/k/v bias: ``qkv_bias``), Qwen3-MoE's routing, plus a shared expert of
  ``shared_expert_intermediate_size`` every token takes, scaled by sigmoid(``shared_expert_gate``(x)).
* OLMoE: Qwen3-MoE's routing (top-k renormalised with ``norm_topk_prob``, default off; routing weights
  in the model dtype) over ``num_experts`` experts of ``intermediate_size`` rows in every layer, no
  shared expert; its q and k RMSNorms span the whole projection (all heads: ``qk_norm_whole``, so
  not split over tensor-parallel ranks), and ``clip_qkv`` clamps q, k and v after them.
* Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` in checkpoints and adapters, a sliding window on every
  layer, and LongRoPE ("longrope"; old configs say "su" or "yarn" for it).
"""

from __future__ import annotations

import math
from typing import Any, Callable

MODEL_TYPES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
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


def _olmoe(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("sliding_window") is not None:
        raise ValueError("sliding_window is not supported for OLMoE (transformers' OLMoE masks every layer fully)")
    bias = bool(raw.get("attention_bias", False))
    return dict(hidden_act=_silu_only(raw), qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_whole=True,
                clip_qkv=raw.get("clip_qkv"), num_experts=_num_experts(raw),
                num_experts_per_tok=raw.get("num_experts_per_tok", 8), moe_intermediate_size=raw["intermediate_size"],
                norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=tuple(range(raw["num_hidden_layers"])),
                moe_naming="qwen_moe")


def _phi3(raw: dict[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    return dict(hidden_act=_silu_only(raw), fused_projections=True,
                sliding_windows=() if window is None else (window,) * raw["num_hidden_layers"])


def _num_experts(raw: dict[str, Any]) -> int:
    # Hub Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts for both families
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts:
        raise ValueError("config.json lacks 'num_local_experts' / 'num_experts'")
    return experts


def _mixtral(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(**_mistral(raw), num_experts=_num_experts(raw), num_experts_per_tok=raw.get("num_experts_per_tok", 2),
                moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                moe_layers=tuple(range(raw["num_hidden_layers"])), moe_naming="mixtral", router_weights_in_float=True)


def _qwen_sparse_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """Qwen MoE layers: every decoder_sparse_step-th, but those mlp_only_layers keeps dense."""
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
    return tuple(i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def _qwen2_moe(raw: dict[str, Any]) -> dict[str, Any]:
    return dict(**_qwen2(raw) | {"qkv_bias": bool(raw.get("qkv_bias", True))}, num_experts=_num_experts(raw),
                num_experts_per_tok=raw.get("num_experts_per_tok", 4), moe_intermediate_size=raw.get("moe_intermediate_size"),
                norm_topk_prob=bool(raw.get("norm_topk_prob")), moe_layers=_qwen_sparse_layers(raw),
                moe_naming="qwen_moe", shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size"))


def _qwen3_moe(raw: dict[str, Any]) -> dict[str, Any]:
    experts, sparse = _num_experts(raw), _qwen_sparse_layers(raw)
    # transformers' Qwen3-MoE slides every layer when the config keeps a window (unlike Qwen3's per-layer rule)
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    options = dict(_qwen3(raw), sliding_windows=() if window is None else (window,) * raw["num_hidden_layers"])
    return dict(**options, num_experts=experts, num_experts_per_tok=raw.get("num_experts_per_tok", 8),
                moe_intermediate_size=raw.get("moe_intermediate_size"), norm_topk_prob=bool(raw.get("norm_topk_prob")),
                moe_layers=sparse, moe_naming="qwen_moe")


_FAMILIES: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "LlamaForCausalLM": _llama, "MistralForCausalLM": _mistral, "Qwen2ForCausalLM": _qwen2,
    "Qwen3ForCausalLM": _qwen3, "Gemma2ForCausalLM": _gemma2, "Phi3ForCausalLM": _phi3,
    "MixtralForCausalLM": _mixtral, "Qwen3MoeForCausalLM": _qwen3_moe, "Qwen2MoeForCausalLM": _qwen2_moe,
    "OlmoeForCausalLM": _olmoe,
}
assert set(_FAMILIES) == set(SUPPORTED_ARCHITECTURES)


def rope_type_alias(architecture: str, rope_type: str) -> str:
    """transformers' Phi-3 reads the older names "su" and "yarn" as LongRoPE."""
    if architecture == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        return "longrope"
    return rope_type
