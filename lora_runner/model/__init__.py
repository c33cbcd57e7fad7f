"""The Llama-family base model: config parsing, checkpoint loading, the decoder with LoRA-aware linears."""

from lora_runner.device import resolve_device, resolve_dtype
from lora_runner.model.config import ModelConfig, RopeConfig
from lora_runner.model.llama import LlamaForCausalLM
from lora_runner.model.loader import load_model, resolve_model_dir

__all__ = [
    "LlamaForCausalLM", "ModelConfig", "RopeConfig", "load_model", "resolve_device",
    "resolve_dtype", "resolve_model_dir",
]
