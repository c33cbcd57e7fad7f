"""The default bound on an adapter file's size: the largest file a valid adapter of this model can be.

Without a bound a tenant's 1.5 GiB (sparse) file is read into memory before it is refused. With
``max_adapter_bytes`` left unset, :class:`adapters.AdapterManager` uses
:func:`default_max_adapter_bytes`: every LoRA factor a PEFT adapter of this model may hold at
``max_lora_rank`` (A and B of every projection slice of every layer, the DoRA magnitudes, LoRA on
embed_tokens and lm_head), in float32, the widest dtype PEFT saves adapters in, plus room for the
safetensors header or the pickle archive's entries; or the largest soft prompt, whichever is
larger. A valid adapter is never over it (a float64 one at full rank can be: raise
``--max-adapter-bytes`` for it).
"""

from __future__ import annotations

from adapters.spec import ModelSpec

_BYTES_PER_ELEMENT = 4  # float32
_FIXED_ALLOWANCE = 1 << 20  # header / metadata / archive directory
_PER_TENSOR_ALLOWANCE = 1 << 10  # one header entry or zip entry per tensor


def default_max_adapter_bytes(spec: ModelSpec, max_lora_rank: int, max_prompt_adapter_tokens: int = 0) -> int:
    """Bytes of the largest adapter file a valid adapter of ``spec`` can need (see module docstring)."""
    elements, tensors = 0, 0
    for module in spec.modules:
        slices = module.slice_sizes
        # each slice its own A [r, K] and B [N_j, r] (split projections), plus a DoRA magnitude [N_j]
        elements += len(slices) * max_lora_rank * module.in_features + sum(slices) * (max_lora_rank + 1)
        tensors += 3 * len(slices)
    if spec.vocab_size is not None:  # embed_tokens and lm_head: A and B of each
        elements += 2 * max_lora_rank * (spec.vocab_size + spec.hidden_size)
        tensors += 4
    lora = elements * _BYTES_PER_ELEMENT + tensors * _PER_TENSOR_ALLOWANCE
    prompt = max_prompt_adapter_tokens * spec.hidden_size * _BYTES_PER_ELEMENT + _PER_TENSOR_ALLOWANCE
    return max(lora, prompt) + _FIXED_ALLOWANCE
