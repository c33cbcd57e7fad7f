"""Gemma 2: the Llama decoder with Gemma's options (ModelConfig), plus its two model-level steps.

* Embeddings are multiplied by ``sqrt(hidden)`` rounded to the model dtype, as transformers does
  (``Gemma2TextScaledWordEmbedding``). Soft-prompt rows are not scaled: PEFT prompt tuning puts its
  virtual-token embeddings next to the scaled token embeddings, as they are.
* Final logits are soft-capped: ``cap * tanh(logits / cap)``, after the LM head.

Everything inside the decoder layers (norms, GeGLU, attention scale and soft-capping, sliding
windows) is a ModelConfig option of lora_runner/model/llama.py.
"""

from __future__ import annotations

import torch

from lora_runner.distributed import SINGLE, TensorParallel
from lora_runner.model.config import ModelConfig
from lora_runner.model.forward_context import PromptAdapterContext
from lora_runner.model.llama import LlamaForCausalLM


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 checkpoints: scaled embeddings and final logit soft-capping around the Llama decoder."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                 tp: TensorParallel = SINGLE):
        super().__init__(config, dtype=dtype, device=device, tp=tp)
        # rounded as transformers does: a float32 buffer cast to the weights' dtype
        scale = torch.tensor(config.embedding_scale or 1.0, dtype=torch.float32, device=device).to(dtype)
        self.register_buffer("embedding_scale", scale, persistent=False)

    def embed(self, input_ids: torch.Tensor, prompt_adapter: PromptAdapterContext | None, *args,
              **kwargs) -> torch.Tensor:
        """The decoder's embeddings [T, hidden], token rows scaled (soft-prompt rows as they are)."""
        hidden = super().embed(input_ids, prompt_adapter, *args, **kwargs)  # [T, hidden]
        scaled = hidden * self.embedding_scale
        if prompt_adapter is None:
            return scaled
        return torch.where((prompt_adapter.token_slots >= 0)[:, None], hidden, scaled)

    def compute_logits(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Soft-capped logits [S, vocab] float32 of the rows to sample."""
        logits = super().compute_logits(hidden, *args, **kwargs)  # [S, vocab] float32
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"Gemma2ForCausalLM": Gemma2ForCausalLM}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The decoder class of `config`'s architecture (LlamaForCausalLM unless it needs more)."""
    return MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)
