"""The base model's shape as adapters see it, and the packed-module layout of LoRA slots.

The engine's LoRA-aware linears are packed: q,k,v share one linear ("qkv", 3 slices) and gate,up
share one ("gate_up", 2 slices); o and down are single-slice. A PEFT module name maps to
(packed module, slice index). Device slots hold, per layer and packed module,
``lora_a [max_loras, n_slices, R, K]`` and ``lora_b [max_loras, N, R]`` (design.md section 3).

Phi-3 checkpoints and the PEFT adapters trained on them name the packed modules themselves
("qkv_proj", "gate_up_proj"): one PEFT module covers every slice of a packed module (its A is
shared by the slices, its B rows are the slices' rows in order).
"""

from __future__ import annotations

from dataclasses import dataclass

# PEFT leaf module name -> (packed module, slice index within it)
PEFT_TO_PACKED: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
# Fused PEFT leaf module (Phi-3) -> the packed module whose slices it covers, all of them
FUSED_TO_PACKED: dict[str, str] = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
PACKED_MODULES: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
# PEFT leaf module -> its parent in a Llama-family decoder layer ("self_attn" or "mlp")
PEFT_PARENT: dict[str, str] = {
    "q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
    "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "qkv_proj": "self_attn", "gate_up_proj": "mlp",
}
SPLIT_MODULES: tuple[str, ...] = tuple(PEFT_TO_PACKED)  # q_proj ... down_proj: Llama, Mistral, Qwen, Gemma
FUSED_MODULES: tuple[str, ...] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # Phi-3


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of a Llama-family base model that adapters must agree with."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    model_name: str | None = None  # for the "adapter trained on another base" warning
    vocab_size: int | None = None  # embed_tokens / lm_head rows; None: LoRA on them is refused
    fused_projections: bool = False  # Phi-3: modules are named qkv_proj / gate_up_proj (FUSED_MODULES)

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                      "intermediate_size"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelSpec.{field} must be positive")
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError("ModelSpec.vocab_size must be positive or None")

    def slice_sizes(self, packed: str) -> tuple[int, ...]:
        """Output widths of the slices of a packed module."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "qkv": (q, kv, kv),
            "o": (self.hidden_size,),
            "gate_up": (self.intermediate_size, self.intermediate_size),
            "down": (self.hidden_size,),
        }[packed]

    def in_features(self, packed: str) -> int:
        """Input width K of a packed module."""
        return {
            "qkv": self.hidden_size,
            "o": self.num_heads * self.head_dim,
            "gate_up": self.hidden_size,
            "down": self.intermediate_size,
        }[packed]

    @property
    def peft_modules(self) -> tuple[str, ...]:
        """The PEFT leaf module names of this model's decoder layers."""
        return FUSED_MODULES if self.fused_projections else SPLIT_MODULES

    def peft_slices(self, peft_module: str) -> tuple[str, tuple[int, ...]]:
        """(packed module, indices of the slices it covers) of one of this model's PEFT modules."""
        if peft_module in FUSED_TO_PACKED:
            packed = FUSED_TO_PACKED[peft_module]
            return packed, tuple(range(len(self.slice_sizes(packed))))
        packed, index = PEFT_TO_PACKED[peft_module]
        return packed, (index,)

    def peft_shapes(self, peft_module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Expected (lora_A [r, in], lora_B [out, r]) shapes of a PEFT module (a fused one: all its rows)."""
        packed, indices = self.peft_slices(peft_module)
        sizes = self.slice_sizes(packed)
        return (rank, self.in_features(packed)), (sum(sizes[i] for i in indices), rank)
