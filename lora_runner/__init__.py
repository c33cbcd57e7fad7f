"""lora_runner: serve many LoRA fine-tunes of one Llama-family base model in one batch."""

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.config import EngineConfig
from lora_runner.engine.async_llm_engine import AsyncLLMEngine
from lora_runner.engine.errors import EngineClosedError
from lora_runner.engine.llm_engine import LLMEngine
from lora_runner.entrypoints.llm import LLM
from lora_runner.outputs import CompletionOutput, RequestOutput
from lora_runner.sampling_params import GuidedDecodingParams, SamplingParams
from lora_runner.structured_outputs_params import StructuredOutputsParams

__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "EngineConfig", "EngineClosedError", "LoRARequest", "PromptAdapterRequest",
           "GuidedDecodingParams"]
