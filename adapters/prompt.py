"""PEFT prompt-tuning checkpoints -> a validated soft prompt [num_virtual_tokens, hidden].

Supported: peft_type PROMPT_TUNING for decoder-only models (one transformer submodule), with any
init (RANDOM / TEXT / SAMPLE_VOCAB: the trained embeddings are in the file). Refused with
:class:`UnsupportedAdapterError`: other prompt methods (P-tuning, prefix tuning, multitask prompt
tuning), encoder-decoder prompts (num_transformer_submodules != 1), and modules_to_save.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from adapters.base_model import warn_if_other_base
from adapters.cache_memory import held_bytes
from adapters.errors import AdapterTooLargeError, InvalidAdapterError, UnsupportedAdapterError
from adapters.spec import ModelSpec
from adapters.files import AdapterDir
from adapters.weights import check_peft_type, held_dir, read_adapter_config, read_adapter_tensors

logger = logging.getLogger(__name__)

EMBEDDINGS_KEY = "prompt_embeddings"
_SUPPORTED_TEXT = "PEFT prompt tuning (peft_type PROMPT_TUNING) for causal LMs"


@dataclass
class PromptWeights:
    """A validated soft prompt, prepended (as placeholder tokens' embeddings) to a request's prompt."""

    name: str
    embeddings: torch.Tensor  # [num_virtual_tokens, hidden]

    @property
    def num_virtual_tokens(self) -> int:
        """How many placeholder tokens the soft prompt occupies."""
        return self.embeddings.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of memory the embeddings hold (their whole storage, adapters.cache_memory)."""
        return held_bytes([self.embeddings])

    def size(self) -> int:
        """The adapter's size as the manager reports it (its number of virtual tokens)."""
        return self.num_virtual_tokens

    def pin_memory(self) -> "PromptWeights":
        """A copy in page-locked memory, so slot writes to a GPU are asynchronous."""
        return PromptWeights(self.name, self.embeddings.pin_memory())


def _check_config(name: str, config: dict, spec: ModelSpec, max_tokens: int) -> int:
    """Validate the config; returns num_virtual_tokens."""
    check_peft_type(name, config, "PROMPT_TUNING", "a prompt adapter", _SUPPORTED_TEXT)
    if config.get("modules_to_save"):
        raise UnsupportedAdapterError(f"adapter {name!r}: modules_to_save={config['modules_to_save']!r} is not "
                                      f"supported; supported: {_SUPPORTED_TEXT}")
    submodules = config.get("num_transformer_submodules")
    if submodules not in (None, 1):
        raise UnsupportedAdapterError(f"adapter {name!r}: num_transformer_submodules={submodules!r} (an "
                                      f"encoder-decoder prompt) is not supported; supported: {_SUPPORTED_TEXT}")
    num_tokens = config.get("num_virtual_tokens")
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
        raise InvalidAdapterError(f"adapter {name!r}: num_virtual_tokens must be a positive int, got {num_tokens!r}")
    if num_tokens > max_tokens:
        raise AdapterTooLargeError(f"adapter {name!r}: num_virtual_tokens={num_tokens} is over "
                                   f"max_prompt_adapter_tokens={max_tokens}")
    token_dim = config.get("token_dim")
    if token_dim is not None and token_dim != spec.hidden_size:
        raise InvalidAdapterError(f"adapter {name!r}: token_dim={token_dim} does not match the base model's "
                                  f"hidden size {spec.hidden_size} (adapter trained on a different model?)")
    warn_if_other_base("prompt adapter", name, config.get("base_model_name_or_path"), spec.model_name)
    return num_tokens


def parse_prompt_adapter(name: str, config: dict, tensors: dict[str, torch.Tensor], spec: ModelSpec, *,
                         max_prompt_adapter_tokens: int, dtype: torch.dtype = torch.float32) -> PromptWeights:
    """Validate a PEFT prompt-tuning adapter (config + state dict) and convert it to :class:`PromptWeights`.

    Raises:
        UnsupportedAdapterError: not plain prompt tuning of a causal LM.
        AdapterTooLargeError: more virtual tokens than ``max_prompt_adapter_tokens``.
        InvalidAdapterError: bad config, missing/extra keys, wrong shape, non-float or non-finite values.
    """
    num_tokens = _check_config(name, config, spec, max_prompt_adapter_tokens)
    extra = sorted(set(tensors) - {EMBEDDINGS_KEY})
    if extra:
        raise InvalidAdapterError(f"adapter {name!r}: unexpected key {extra[0]!r}; a prompt-tuning adapter holds "
                                  f"only {EMBEDDINGS_KEY!r}")
    if EMBEDDINGS_KEY not in tensors:
        raise InvalidAdapterError(f"adapter {name!r}: missing key {EMBEDDINGS_KEY!r}")
    emb = tensors[EMBEDDINGS_KEY]  # [num_virtual_tokens, hidden]
    expected = (num_tokens, spec.hidden_size)
    if tuple(emb.shape) != expected:
        raise InvalidAdapterError(f"adapter {name!r}: {EMBEDDINGS_KEY} has shape {tuple(emb.shape)}, expected "
                                  f"{expected} (num_virtual_tokens, hidden size of the base model)")
    if not emb.is_floating_point():
        raise InvalidAdapterError(f"adapter {name!r}: {EMBEDDINGS_KEY} has dtype {emb.dtype}; floating point expected")
    if not torch.isfinite(emb).all():
        raise InvalidAdapterError(f"adapter {name!r}: {EMBEDDINGS_KEY} contains NaN or inf")
    out = emb.to(dtype).contiguous()  # [num_virtual_tokens, hidden]
    if not torch.isfinite(out).all():
        raise InvalidAdapterError(f"adapter {name!r}: {EMBEDDINGS_KEY} overflows {dtype}")
    return PromptWeights(name, out)


def load_prompt_adapter(name: str, local_dir: str | AdapterDir, spec: ModelSpec, *,
                        max_prompt_adapter_tokens: int, dtype: torch.dtype = torch.float32, allow_pickle: bool = False,
                        max_bytes: int | None = None) -> PromptWeights:
    """Read and validate the PEFT prompt-tuning adapter in ``local_dir`` (a path or a held directory,
    as in adapters.lora.load_lora; config checked before weights)."""
    with held_dir(local_dir) as directory:
        config = read_adapter_config(name, directory, max_bytes)
        _check_config(name, config, spec, max_prompt_adapter_tokens)
        tensors = read_adapter_tensors(name, directory, allow_pickle=allow_pickle, max_bytes=max_bytes)
    return parse_prompt_adapter(name, config, tensors, spec, max_prompt_adapter_tokens=max_prompt_adapter_tokens,
                                dtype=dtype)


def dummy_prompt_adapter(name: str, spec: ModelSpec, num_virtual_tokens: int, dtype: torch.dtype = torch.float32,
                         scale: float = 0.01, seed: int = 0) -> PromptWeights:
    """A soft prompt of the right shape (small random values; no file) for warmup and profiling."""
    gen = torch.Generator().manual_seed(seed)
    emb = (torch.randn(num_virtual_tokens, spec.hidden_size, generator=gen) * scale).to(dtype)
    return PromptWeights(name, emb)  # [num_virtual_tokens, hidden]
