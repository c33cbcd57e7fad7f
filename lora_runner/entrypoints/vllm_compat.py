"""vLLM's spellings that ``LLM`` translates: its keywords (one table) and its prompt dicts.

A vLLM user's ``LLM(model, enable_lora=True, trust_remote_code=False, swap_space=4, ...)`` should run
unchanged where it can and fail with one ValueError naming the keyword where it cannot. Each entry of
``VLLM_OPTIONS`` says which values are honoured and why: a no-op (the behaviour vLLM asks for is what
this engine always does), a keyword that maps to an EngineConfig field under another name, or a
feature this engine does not have (any other value is refused with the entry's reason).
``engine_kwargs`` applies the table; EngineConfig fields always win over it, so a field added to
EngineConfig later (a tokenizer option, say) is used as given without editing this file.
``structured_outputs_backend`` reads vLLM's StructuredOutputsConfig (its keys: one more table), for ``LLM`` and
``serve --structured-outputs-config`` alike.
``prompt_from_dict`` reads vLLM's TextPrompt / TokensPrompt dicts and refuses multimodal inputs by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lora_runner.config import EngineConfig
from lora_runner.structured_outputs_params import BACKEND_NAMES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmOption:
    """How ``LLM`` treats one vLLM keyword.

    accepts: the values honoured (others raise ValueError with ``reason``).
    reason: why an accepted value changes nothing here, or why other values are refused.
    field: the EngineConfig field the keyword sets (vLLM's other name for it); None: the keyword is dropped.
    implies: EngineConfig defaults a true value sets (only where the caller left them out).
    convert: the field's value of the keyword's (ValueError naming what it cannot honour; None: it sets
        nothing); None: the value as given.
    """

    accepts: Callable[[Any], bool]
    reason: str
    field: str | None = None
    implies: tuple[tuple[str, Any], ...] = ()
    convert: Callable[[Any], Any] | None = None


def _any(value) -> bool:
    return True


def _one_of(*values) -> Callable[[Any], bool]:
    """Equal to one of `values`; a bool only to itself (True is no 1 here)."""
    def accepts(value) -> bool:
        return any(value is v or not isinstance(value, bool) and not isinstance(v, bool) and _equal(value, v)
                   for v in values)
    return accepts


def _equal(value, expected) -> bool:
    try:
        return bool(value == expected)
    except (TypeError, ValueError):  # an == that raises or is no bool (an array): not the expected value
        return False


def _none_or(*values) -> Callable[[Any], bool]:
    return _one_of(None, *values)


_CUSTOM_CODE = "models with custom code are not run: the Llama-family architectures of lora_runner.model only"
_HF_CACHE = "models and adapters are read from the Hugging Face cache (set HF_HOME or HF_HUB_CACHE to move it)"
_TEXT_ONLY = "the served models are text-only decoders: no multimodal inputs"
_OTHER_BACKENDS = "structured outputs are compiled by xgrammar or llguidance: auto, xgrammar, guidance or llguidance"
_NO_FALLBACK = "a constraint is compiled by the server's backend only, never by another"
_CLOSED_OBJECTS = ("both backends read an object schema with properties as taking no others unless it says so "
                   "(xgrammar's strict mode): disable_additional_properties=True is always the case")
_WHITESPACE_PER_REQUEST = ("compact JSON is chosen per request here: structured_outputs.disable_any_whitespace "
                           "(GuidedDecodingParams(disable_any_whitespace=True) in Python)")
_NO_REASONING = "no reasoning parser runs here: structured outputs constrain the whole output"


def _is_backend(value) -> bool:
    return isinstance(value, str) and value in BACKEND_NAMES


def _backend_field(name: str) -> str | None:
    """structured_outputs_backend of vLLM's backend `name`; None for "auto", which asks for nothing (the default)."""
    return None if name == "auto" else BACKEND_NAMES[name]


# the keys of vLLM's StructuredOutputsConfig (serve --structured-outputs-config, LLM(structured_outputs_config=));
# only backend sets anything (EngineConfig.structured_outputs_backend)
STRUCTURED_OUTPUTS_KEYS: dict[str, VllmOption] = {
    "backend": VllmOption(_is_backend, _OTHER_BACKENDS, field="structured_outputs_backend", convert=_backend_field),
    "disable_fallback": VllmOption(_one_of(False, True), _NO_FALLBACK),
    "disable_additional_properties": VllmOption(_one_of(False, True), _CLOSED_OBJECTS),
    "disable_any_whitespace": VllmOption(_one_of(False), _WHITESPACE_PER_REQUEST),
    "reasoning_parser": VllmOption(_none_or(""), _NO_REASONING),
    "reasoning_parser_plugin": VllmOption(_none_or(""), _NO_REASONING),
    "enable_in_reasoning": VllmOption(_none_or(False), _NO_REASONING),
}

VLLM_OPTIONS: dict[str, VllmOption] = {
    # honoured: what vLLM asks for is what this engine always does
    "enable_lora": VllmOption(_any, "LoRA is always enabled; size it with max_loras, max_lora_rank, max_cpu_loras"),
    "enable_chunked_prefill": VllmOption(_none_or(True), "prompts longer than max_num_batched_tokens are always "
                                         "prefilled in chunks; chunking cannot be turned off"),
    "disable_log_stats": VllmOption(_any, "the engine logs no periodic statistics (the server's /metrics has them)"),
    "swap_space": VllmOption(_any, "a preempted request recomputes its KV cache; nothing is swapped to the CPU"),
    "served_model_name": VllmOption(_any, "LLM serves no HTTP model list (serve --served-model-name does)"),
    "disable_custom_all_reduce": VllmOption(_any, "tensor parallelism all-reduces through torch.distributed only"),
    "max_seq_len_to_capture": VllmOption(_any, "CUDA graphs capture decode steps, whose size does not depend on "
                                         "the sequence length"),
    "fully_sharded_loras": VllmOption(_any, "a performance choice in vLLM; LoRA weights here always split with "
                                      "their base layer over tensor-parallel ranks (adapters.sharding)"),
    "use_v2_block_manager": VllmOption(_any, "there is one block manager"),
    "enable_prompt_adapter": VllmOption(_any, "prompt adapters are on when max_prompt_adapters and "
                                        "max_prompt_adapter_tokens are > 0", implies=(("max_prompt_adapters", 1),)),
    # vLLM's names of EngineConfig fields
    "max_prompt_adapter_token": VllmOption(_any, "vLLM's name of max_prompt_adapter_tokens",
                                           field="max_prompt_adapter_tokens"),
    # features this engine does not have: only vLLM's default (or a value that asks for nothing) passes
    "trust_remote_code": VllmOption(_none_or(False), _CUSTOM_CODE),
    "tokenizer": VllmOption(_none_or(), "the tokenizer is the model's own (its directory or Hub repo); "
                            "pass tokenizer=None or the model's path"),
    "tokenizer_revision": VllmOption(_none_or(), "the tokenizer is read at the model's revision"),
    "tokenizer_mode": VllmOption(_none_or("auto"), "the tokenizer is loaded with transformers' AutoTokenizer "
                                 "(tokenizer_mode='auto')"),
    "skip_tokenizer_init": VllmOption(_none_or(False), "the tokenizer is loaded when first needed anyway; a model "
                                      "directory without one serves token-id prompts"),
    "download_dir": VllmOption(_none_or(), _HF_CACHE),
    "hf_token": VllmOption(_none_or(), "the Hub token is huggingface_hub's: set HF_TOKEN"),
    "hf_overrides": VllmOption(_none_or(), "config.json is read as it is: " + _CUSTOM_CODE),
    "load_format": VllmOption(_none_or("auto", "safetensors"), "weights are read from the checkpoint's "
                              "safetensors files (lora_runner.model)"),
    "kv_cache_dtype": VllmOption(_none_or("auto"), "the KV cache is kept in the model's dtype"),
    "cpu_offload_gb": VllmOption(_none_or(0), "weights are not offloaded to the CPU"),
    "pipeline_parallel_size": VllmOption(_none_or(1), "tensor parallelism only (tensor_parallel_size)"),
    "data_parallel_size": VllmOption(_none_or(1), "one engine per process: run one LLM per data-parallel replica"),
    "enable_expert_parallel": VllmOption(_none_or(False), "no mixture-of-experts models are served"),
    "enable_sleep_mode": VllmOption(_none_or(False), "sleep mode is not implemented: close() frees the engine"),
    "lora_extra_vocab_size": VllmOption(_none_or(0), "adapters that add tokens to the vocabulary are not served"),
    "long_lora_scaling_factors": VllmOption(_none_or(), "long-context LoRA (scaled rotary embeddings per "
                                            "adapter) is not implemented"),
    "lora_dtype": VllmOption(_none_or("auto"), "LoRA slots are kept in the model's dtype"),
    "compilation_config": VllmOption(_none_or(0), "there is no torch.compile step (enforce_eager chooses "
                                     "CUDA graphs)"),
    "logits_processors": VllmOption(_none_or(), "custom logits processors are not supported; SamplingParams has "
                                    "allowed_token_ids, bad_words and structured_outputs"),
    # vLLM's structured-output settings (STRUCTURED_OUTPUTS_KEYS): the backend is structured_outputs_backend
    "structured_outputs_config": VllmOption(_any, "vLLM's StructuredOutputsConfig", field="structured_outputs_backend",
                                            convert=lambda config: structured_outputs_backend(
                                                config, "LLM(structured_outputs_config)")),
    "guided_decoding_backend": VllmOption(_is_backend, _OTHER_BACKENDS, field="structured_outputs_backend",
                                          convert=_backend_field),
    "guided_decoding_disable_fallback": VllmOption(_one_of(False, True), _NO_FALLBACK),
    "guided_decoding_disable_additional_properties": VllmOption(_one_of(False, True), _CLOSED_OBJECTS),
    "guided_decoding_disable_any_whitespace": VllmOption(_one_of(False), _WHITESPACE_PER_REQUEST),
    "limit_mm_per_prompt": VllmOption(_none_or(), _TEXT_ONLY),
    "mm_processor_kwargs": VllmOption(_none_or(), _TEXT_ONLY),
    "allowed_local_media_path": VllmOption(_none_or(""), _TEXT_ONLY),
}


def engine_kwargs(model, kwargs: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig keyword arguments for ``LLM(model, **kwargs)`` written with vLLM's keywords.

    EngineConfig fields pass through unchanged; VLLM_OPTIONS entries are dropped (no-ops, logged at
    INFO), renamed to their field, or refused. Raises ValueError naming the keyword for a refused value,
    for a keyword given under both names, and for a keyword that is neither (with the closest names).
    """
    fields = {field.name for field in dataclasses.fields(EngineConfig)}
    result = {name: value for name, value in kwargs.items() if name in fields}
    implied: dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in fields:
            continue
        option = VLLM_OPTIONS.get(name)
        if option is None:
            raise ValueError(_unknown(name, fields))
        if name == "tokenizer" and _same_path(value, model):  # vLLM's habit: the model's own tokenizer named
            continue
        if not option.accepts(value):
            raise ValueError(f"LLM({name}={value!r}) is not supported: {option.reason}")
        if option.field is not None:
            value = value if option.convert is None else option.convert(value)
            if value is None:  # it asks for nothing (a StructuredOutputsConfig without a backend)
                continue
            if option.field in kwargs or result.get(option.field, value) != value:
                given = option.field if option.field in kwargs else "another vLLM keyword that sets it"
                raise ValueError(f"LLM got both {name} (vLLM's name of {option.field}) and {given}: pass one")
            result[option.field] = value
            continue
        if value:
            implied.update(option.implies)
        logger.info("LLM(%s=%r) has no effect here: %s", name, value, option.reason)
    for name, value in implied.items():
        result.setdefault(name, value)
    return result


def structured_outputs_backend(config, where: str) -> str | None:
    """EngineConfig.structured_outputs_backend of vLLM's StructuredOutputsConfig `config` (a dict of its keys, or
    an object with them as attributes); None when it names none, or "auto". The other keys change nothing here
    (logged) or are refused: ValueError naming `where` and the key (STRUCTURED_OUTPUTS_KEYS says why)."""
    if not isinstance(config, Mapping):
        config = getattr(config, "__dict__", None)
        if config is None:
            raise ValueError(f"{where} must be a dict of vLLM's StructuredOutputsConfig keys "
                             f"({', '.join(STRUCTURED_OUTPUTS_KEYS)})")
    backend = None
    for key, value in config.items():
        option = STRUCTURED_OUTPUTS_KEYS.get(key)
        if option is None:
            if key.startswith("_"):  # a dataclass's private state
                continue
            raise ValueError(f"{where}: unknown key {key!r} (vLLM's StructuredOutputsConfig has "
                             f"{', '.join(STRUCTURED_OUTPUTS_KEYS)})")
        if not option.accepts(value):
            raise ValueError(f"{where}: {key}={value!r} is not supported: {option.reason}")
        if option.field is not None:
            backend = option.convert(value)
        elif value:
            logger.info("%s: %s=%r has no effect here: %s", where, key, value, option.reason)
    return backend


def _same_path(value, model) -> bool:
    return isinstance(value, str) and isinstance(model, str) and os.path.normpath(value) == os.path.normpath(model)


def refusal(name: str, value) -> str | None:
    """Why vLLM keyword `name` with `value` is refused (None: it is honoured, or not in the table)."""
    option = VLLM_OPTIONS.get(name)
    return None if option is None or option.accepts(value) else option.reason


def _unknown(name: str, fields: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(fields | VLLM_OPTIONS.keys()), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return (f"LLM got an unknown keyword {name!r}{hint}: not an EngineConfig field, nor a vLLM option this engine "
            "knows (lora_runner.entrypoints.vllm_compat.VLLM_OPTIONS)")


# vLLM prompt-dict keys (TextPrompt, TokensPrompt and their relatives) this engine cannot serve, and why
_REFUSED_PROMPT_KEYS = {
    "multi_modal_data": _TEXT_ONLY,
    "mm_processor_kwargs": _TEXT_ONLY,
    "multi_modal_uuids": _TEXT_ONLY,
    "prompt_embeds": "a prompt is text or token ids, not embeddings",
    "token_type_ids": "token type ids are for encoder (pooling) models, which are not served",
    "encoder_prompt": "no encoder-decoder models are served",
    "decoder_prompt": "no encoder-decoder models are served",
}


# keys that make a dict vLLM's prompt dict rather than a tokenizer output (whose key is input_ids)
VLLM_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "prompt_embeds", "encoder_prompt",
                              "decoder_prompt"})


def prompt_from_dict(prompt: Mapping, index: int) -> tuple[Any, str | None]:
    """(prompt, cache salt) of vLLM's prompt dict: ``{"prompt": text}`` (TextPrompt) or
    ``{"prompt_token_ids": ids}`` (TokensPrompt; a "prompt" text beside them is only a label, as in
    vLLM), each optionally with "cache_salt". ValueError naming prompt `index` and the key for anything
    else, multimodal inputs included (an empty or None value of such a key asks for nothing and passes)."""
    for key, value in prompt.items():
        if key in ("prompt", "prompt_token_ids", "cache_salt"):
            continue
        reason = _REFUSED_PROMPT_KEYS.get(key)
        if reason is None:
            raise ValueError(f"prompt {index}: unknown key {key!r} in a prompt dict (vLLM's keys: prompt, "
                             "prompt_token_ids, cache_salt)")
        if not (value is None or isinstance(value, (dict, list, tuple)) and not value):
            raise ValueError(f"prompt {index}: {key} is not supported: {reason}")
    salt = prompt.get("cache_salt")
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"], salt
    text = prompt.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' (a string) or 'prompt_token_ids' (a list "
                         f"of token ids), got keys {sorted(prompt)}")
    return text, salt
