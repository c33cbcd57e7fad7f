"""The base model's architecture, parsed from a transformers ``config.json``.

What differs per family (Qwen3's q/k norms, Gemma 2's soft-capping, Phi-3's fused projections, ...)
is read by lora_runner/model/families.py into the options below. Reads both config formats seen on
the Hub: the current one (``rope_parameters`` holding ``rope_theta`` and ``rope_type``) and the
older one (top-level ``rope_theta`` plus a ``rope_scaling`` dict with ``type`` or ``rope_type``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters import ModelSpec
from lora_runner.model.families import (
    HIDDEN_ACTS, MODEL_TYPES, SUPPORTED_ARCHITECTURES, family_options, rope_type_alias,
)
from lora_runner.model.lora_linear import decoder_lora_modules
from lora_runner.model.moe_fp8 import FLOAT_MODULES
from lora_runner.model.quant.config import QuantConfig, parse_quantization

logger = logging.getLogger(__name__)

# rope_type -> keys that must be present in the scaling dict
ROPE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
}
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base wavelength plus the scaling scheme (None = plain RoPE)."""

    theta: float = DEFAULT_ROPE_THETA
    scaling: dict[str, Any] | None = None  # always has "rope_type" (linear/dynamic/llama3/yarn/longrope) when set

    @property
    def rope_type(self) -> str:
        """'default', 'linear', 'dynamic', 'llama3', 'yarn' or 'longrope'."""
        return self.scaling["rope_type"] if self.scaling else "default"

    def __post_init__(self) -> None:
        if self.theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.theta}")
        if self.scaling is None:
            return
        rope_type = self.scaling.get("rope_type")
        if rope_type not in ROPE_TYPES or rope_type == "default":
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: "
                             f"{', '.join(t for t in ROPE_TYPES if t != 'default')}")
        missing = [k for k in ROPE_TYPES[rope_type] if self.scaling.get(k) is None]
        if missing:
            raise ValueError(f"rope scaling {rope_type!r} needs {', '.join(missing)} in config.json")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes and options of a Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Phi-3; Mixtral,
    Qwen3-MoE, Qwen2-MoE and OLMoE: sparse-MoE MLPs)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; attention_bias of Llama, Qwen3, Gemma 2
    o_bias: bool = False  # attention_bias of Llama, Qwen3, Gemma 2
    mlp_bias: bool = False  # Llama mlp_bias
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_windows: tuple[int | None, ...] = ()  # per layer: attend to the last w tokens; None = full
    hidden_act: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on each q and k head before RoPE
    qk_norm_whole: bool = False  # OLMoE (with qk_norm): the q and k norms span the whole projection, every head
    clip_qkv: float | None = None  # OLMoE: q, k and v clamped to [-clip_qkv, clip_qkv] after the norms
    norm_unit_offset: bool = False  # Gemma: RMSNorm weights are applied as (1 + w)
    sandwich_norms: bool = False  # Gemma 2: norms after attention and around the MLP too
    embedding_scale: float | None = None  # Gemma: embeddings times sqrt(hidden), rounded to the model dtype
    query_pre_attn_scalar: float | None = None  # Gemma 2: softmax scale is this ** -0.5 (None: head_dim)
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap) before softmax
    final_logit_softcap: float | None = None  # Gemma 2: logits -> cap * tanh(logits / cap)
    fused_projections: bool = False  # Phi-3: qkv_proj and gate_up_proj tensors (checkpoint and adapters)
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    name_or_path: str | None = None
    quantization: QuantConfig | None = None  # quantized decoder linears (config.json or quantization="fp8")
    # Sparse mixture of experts (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE; lora_runner/model/moe.py); 0: dense
    num_experts: int = 0  # routed experts of each sparse layer
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int | None = None  # each expert's intermediate rows
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    moe_layers: tuple[int, ...] = ()  # layers whose MLP is the sparse-MoE block (the others: dense MLP)
    moe_naming: str = ""  # checkpoint / PEFT names: "mixtral" (block_sparse_moe, w1/w3/w2) or "qwen_moe"
    router_weights_in_float: bool = False  # Mixtral: the routing weights stay float32 (Qwen MoEs: model dtype)
    shared_expert_intermediate_size: int | None = None  # Qwen2-MoE's shared expert (None: none)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: "
                             f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for "
                             f"{self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.sliding_windows):
            raise ValueError(f"sliding windows must be positive, got {self.sliding_windows}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "embedding_scale",
                     "clip_qkv"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name} must be positive or None, got {value!r}")
        if self.num_experts:
            _check_moe(self)
        if self.quantization is not None:
            modules = decoder_lora_modules(self)
            self.quantization.check_in_features({m.name: m.in_features for m in modules})
            # what the checkpoint may leave unquantized: what the model reads unquantized (an MoE router)
            self.quantization.check_ignore(path for m in modules if m.name not in FLOAT_MODULES
                                           for path, _ in m.peft_modules)

    @property
    def attn_scale(self) -> float:
        """The softmax scale of attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def sliding_window(self, layer: int) -> int | None:
        """The attention window of `layer` (None: full causal attention)."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (config.json may give one int or a list)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    def spec(self) -> ModelSpec:
        """What adapters must agree with: the sizes and the LoRA modules the decoder's layers declare
        (lora_runner.model.lora_linear.decoder_lora_modules, the function they are built with)."""
        return ModelSpec(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                         intermediate_size=self.intermediate_size, model_name=self.name_or_path,
                         vocab_size=self.vocab_size, fused_projections=self.fused_projections,
                         modules=decoder_lora_modules(self))

    @classmethod
    def from_dir(cls, model_dir: str | Path, name_or_path: str | None = None,
                 quantization: str | None = None) -> ModelConfig:
        """Parse ``<model_dir>/config.json``; FileNotFoundError names the file when it is missing.
        quantization: the engine's option (None or "fp8", see :meth:`from_dict`)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model dir {str(model_dir)!r}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        return cls.from_dict(raw, name_or_path=name_or_path or str(model_dir), quantization=quantization)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name_or_path: str | None = None,
                  quantization: str | None = None) -> ModelConfig:
        """Build from a parsed transformers config dict (ValueError for anything unsupported, a
        ``quantization_config`` this code does not implement included: lora_runner.model.quant.config).
        quantization "fp8": quantize a float checkpoint's decoder linears to FP8 at load."""
        architecture = _architecture(raw)
        num_layers = _require(raw, "num_hidden_layers")
        num_heads = _require(raw, "num_attention_heads")
        hidden_size = _require(raw, "hidden_size")
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=_require(raw, "vocab_size"),
            hidden_size=hidden_size,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden_size // num_heads,
            intermediate_size=_require(raw, "intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=_require(raw, "max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", architecture == "Gemma2ForCausalLM")),
            rope=_rope(raw, architecture),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=raw.get("pad_token_id"),
            name_or_path=name_or_path or raw.get("_name_or_path") or None,
            quantization=parse_quantization(raw, quantization),
            **family_options(architecture, raw),
        )


def _check_moe(config: ModelConfig) -> None:
    """ValueError for MoE sizes that cannot route, or a quantized MoE other than FP8 (online or compressed-tensors:
    the 4-bit formats are not implemented for the experts)."""
    if not 0 < config.num_experts_per_tok <= config.num_experts:
        raise ValueError(f"num_experts_per_tok ({config.num_experts_per_tok}) must be in 1..num_experts "
                         f"({config.num_experts})")
    if not isinstance(config.moe_intermediate_size, int) or config.moe_intermediate_size <= 0:
        raise ValueError(f"moe_intermediate_size must be a positive int, got {config.moe_intermediate_size!r}")
    if any(not 0 <= layer < config.num_layers for layer in config.moe_layers):
        raise ValueError(f"moe_layers {config.moe_layers} outside 0..{config.num_layers - 1}")
    if config.shared_expert_intermediate_size is not None and not config.shared_expert_intermediate_size > 0:
        raise ValueError(f"shared_expert_intermediate_size must be positive, got {config.shared_expert_intermediate_size!r}")
    if config.moe_naming not in ("mixtral", "qwen_moe"):
        raise ValueError(f"moe_naming must be 'mixtral' or 'qwen_moe', got {config.moe_naming!r}")
    quant = config.quantization
    if quant is not None and quant.kind != "fp8":  # FP8 experts: lora_runner.model.moe_fp8
        raise ValueError(f"quantized mixture-of-experts checkpoints are not supported ({quant.kind} from "
                         f"{quant.source} on {config.architecture}): serve a compressed-tensors FP8 checkpoint, or the "
                         "float one with quantization='fp8' to quantize its experts at load")


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"config.json lacks {key!r}")
    return raw[key]


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in MODEL_TYPES:  # configs saved without a model class
        return MODEL_TYPES[raw["model_type"]]
    if not archs:
        raise ValueError(f"config.json has neither 'architectures' nor a known 'model_type' "
                         f"({raw.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(raw: dict[str, Any], architecture: str) -> RopeConfig:
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.pop("rope_theta", None) or raw.get("rope_theta") or DEFAULT_ROPE_THETA
    rope_type = rope_type_alias(architecture, params.pop("rope_type", None) or params.pop("type", None) or "default")
    params.pop("type", None)
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported for Llama-family models")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "longrope" and raw.get("original_max_position_embeddings") is not None:
        # transformers gives Phi-3's top-level value priority over the one in the rope dict
        params["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    if rope_type in ("llama3", "yarn", "longrope") and params.get("original_max_position_embeddings") is None:
        # transformers falls back to max_position_embeddings for these
        params["original_max_position_embeddings"] = raw.get("max_position_embeddings")
    return RopeConfig(theta=float(theta), scaling={"rope_type": rope_type, **params})
