"""LLM: the offline API. generate() runs a list of prompts, each with its own adapters, to completion."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import count

import torch
from tqdm.auto import tqdm

from adapters import LoRARequest, PromptAdapterRequest
from lora_runner.engine.adapter_api import AdapterAPI
from lora_runner.engine.adapters import EngineAdapters
from lora_runner.engine.chat import as_conversations, chat_token_ids, encoding_token_ids, tensor_token_ids
from lora_runner.engine.llm_engine import LLMEngine
from lora_runner.entrypoints.openai.generation_defaults import sampling_defaults
from lora_runner.entrypoints.vllm_compat import VLLM_PROMPT_KEYS, engine_kwargs, prompt_from_dict
from lora_runner.outputs import RequestOutput
from lora_runner.sampling_params import SamplingParams
from lora_runner.structured_outputs_params import StructuredOutputsParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]  # a tokenizer output, a vLLM prompt dict or a 1-D int tensor is converted
_IDLE_WAIT_S = 1.0  # longest sleep of generate() between steps while every request waits for a load


class LLM(AdapterAPI):
    """One base model serving many LoRA and prompt adapters: ``LLM(model, **EngineConfig kwargs)``.

    vLLM's keywords are read too (lora_runner.entrypoints.vllm_compat.VLLM_OPTIONS): ``enable_lora=True`` and other
    settings that ask for what this engine always does are accepted, ``max_prompt_adapter_token`` is
    max_prompt_adapter_tokens, and a feature this engine lacks (``trust_remote_code=True``, say) or an
    unknown keyword is a ValueError naming it. ``generation_config`` is vLLM's: "auto" (the default) takes
    the model's generation_config.json sampling values (temperature, top_p, top_k, min_p,
    repetition_penalty, max_new_tokens as max_tokens) as the params of a call that passes none, "vllm" (or
    None) ignores them, a folder reads its own file: as ``serve --generation-config``.

    ``generate(prompts, sampling_params, lora_request, prompt_adapter_request)`` returns one
    RequestOutput per prompt, in input order; ``chat(messages, ...)`` does the same for chat
    conversations through the tokenizer's chat template. Adapters are managed with add_lora / remove_lora /
    pin_lora / list_loras and add_prompt_adapter / remove_prompt_adapter / pin_prompt_adapter /
    list_prompt_adapters.
    """

    def __init__(self, model: str, generation_config: str | None = "auto", **kwargs) -> None:
        # vLLM's default "auto": the model's generation_config.json sampling values, as `serve` takes them;
        # another setting is checked before the model loads
        defaults = None if generation_config == "auto" else sampling_defaults(generation_config or "vllm", "")
        self.engine = LLMEngine(model, **engine_kwargs(model, kwargs)) if kwargs else LLMEngine(model)
        self._ids = count()
        try:
            self._sampling_defaults = defaults or sampling_defaults("auto", str(self.engine.model_dir))
        except (ValueError, OSError):  # a generation_config.json that is no JSON object
            self.engine.close()
            raise

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a call that passes none (vLLM's): SamplingParams' defaults, with the
        model's generation_config.json values over them unless ``generation_config="vllm"`` (or None)."""
        return self._sampling_defaults.sampling_params()

    def get_tokenizer(self):
        """The model's transformers tokenizer (None when the model directory has none), as vLLM's."""
        return self.engine.tokenizer.get()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 prompt_adapter_request: PromptAdapterRequest | Sequence[PromptAdapterRequest | None] | None = None,
                 use_tqdm: bool = True, cache_salt: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion, continuously batched; outputs in input order.

        prompts: a string, a list of token ids, a 1-D integer tensor, vLLM's prompt dict
        (``{"prompt": text}`` or ``{"prompt_token_ids": ids}``, optionally with "cache_salt"), or a list
        of these; or a tokenizer output (BatchEncoding or dict with ``input_ids``, one prompt or a padded
        batch whose ``attention_mask`` marks the real tokens). sampling_params,
        lora_request and prompt_adapter_request: one for all prompts or a list aligned with them
        (None = no adapter of that kind); a prompt may use a LoRA and a prompt adapter at once.
        cache_salt: one for all prompts or one per prompt; prompts with different salts never share
        prefix-cache blocks (LLMEngine.add_request); a prompt dict's "cache_salt" is that prompt's.
        Every distinct named adapter is loaded and validated, and every distinct structured_outputs
        constraint compiled, before any prompt runs, so a bad adapter raises its adapters.AdapterError
        and a constraint that does not compile its StructuredOutputError (a ValueError) with nothing
        lost. ValueError for misaligned lists,
        an argument of the wrong type, one adapter name bound to two paths/revisions in the call,
        bad sampling params, a bad prompt, or prompt adapters on an engine without prompt-adapter
        slots. Whatever it raises, none of its requests is left in the engine.
        """
        prompt_list, prompt_salts = _as_prompt_list(prompts)
        params = _aligned(sampling_params if sampling_params is not None else self.get_default_sampling_params(),
                          SamplingParams, len(prompt_list), "sampling_params")
        loras = _aligned(lora_request, LoRARequest, len(prompt_list), "lora_request")
        soft_prompts = _aligned(prompt_adapter_request, PromptAdapterRequest, len(prompt_list),
                                "prompt_adapter_request")
        salts = _with_prompt_salts(_aligned(cache_salt, str, len(prompt_list), "cache_salt"), prompt_salts)
        for requests, what in ((loras, "lora_request"), (soft_prompts, "prompt_adapter_request")):
            _check_one_source_per_name(requests, what)
        self._compile_constraints(params)
        for request in dict.fromkeys(r for r in loras if r is not None):
            self.engine.add_lora(request)
        for request in dict.fromkeys(r for r in soft_prompts if r is not None):
            self.engine.add_prompt_adapter(request)
        request_ids = [f"generate-{next(self._ids)}" for _ in prompt_list]
        try:
            for request_id, prompt, p, lora, soft, salt in zip(request_ids, prompt_list, params, loras,
                                                               soft_prompts, salts):
                self.engine.add_request(request_id, prompt, p, lora_request=lora, prompt_adapter_request=soft,
                                        cache_salt=salt)
            return self._run(request_ids, use_tqdm)
        except BaseException:  # re-raised: only makes sure none of this call's requests stays live
            self._abort_and_drain(request_ids)
            raise

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             prompt_adapter_request: PromptAdapterRequest | Sequence[PromptAdapterRequest | None] | None = None,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to chat conversations, as vLLM's ``LLM.chat``.

        messages: one conversation (a list of ``{"role": ..., "content": ...}`` dicts) or a list of
        conversations; one RequestOutput per conversation, in order. Each is rendered with the
        tokenizer's chat template (or `chat_template`, a Jinja string) and tokenized exactly as
        transformers' ``apply_chat_template(tokenize=True)`` does (no second BOS when the template
        writes one). `tools` and `chat_template_kwargs` are passed to the template. The other
        arguments are generate()'s. ValueError for malformed messages, a tokenizer without a chat
        template when none is given, or a template that rejects the messages.
        """
        conversations, _ = as_conversations(messages)
        prompts = chat_token_ids(self.engine.tokenizer.get(), conversations, chat_template=chat_template,
                                 add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, tools=tools,
                                 chat_template_kwargs=chat_template_kwargs)
        return self.generate(prompts, sampling_params, lora_request=lora_request,
                             prompt_adapter_request=prompt_adapter_request, use_tqdm=use_tqdm)

    def _compile_constraints(self, params: list[SamplingParams]) -> None:
        """Compile each distinct structured_outputs constraint of the call and wait for it, so one that
        does not compile raises here (StructuredOutputError, a ValueError, naming its first prompt)
        instead of ending that prompt with finish_reason "error"; the engine's requests then reuse the
        compilation (GrammarCompiler caches it by constraint)."""
        first_prompt: dict[tuple[str, str], tuple[int, StructuredOutputsParams]] = {}
        for index, p in enumerate(params):
            constraint = p.structured_outputs
            if isinstance(constraint, StructuredOutputsParams):  # anything else: add_request refuses it
                constraint.validate()
                first_prompt.setdefault(constraint.key(), (index, constraint))
        for index, constraint in first_prompt.values():
            try:
                self.engine.structured.compiler.compile(constraint).result()
            except ValueError as exc:  # StructuredOutputError; a model without a tokenizer is a ValueError too
                raise type(exc)(f"prompt {index}: {exc}") from exc

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                # sleeps only when the step found nothing to run (every request waits for an adapter
                # load) until a load finishes; the timeout is a safety net, not a poll interval
                self.engine.wait_for_work(timeout=_IDLE_WAIT_S)
        return [finished[request_id] for request_id in request_ids]

    def _abort_and_drain(self, request_ids: list[str]) -> None:
        """Abort this call's requests and step until the engine reports them (the next step does)."""
        self.engine.abort_request(request_ids)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def close(self) -> None:
        """Release the engine's background loader threads."""
        self.engine.close()

    def _adapter_seam(self, check_open: bool = True) -> EngineAdapters:
        """The engine's EngineAdapters, behind add_lora, pin_lora, list_loras, ... (AdapterAPI)."""
        return self.engine._adapter_seam(check_open)


def _as_prompt_list(prompts) -> tuple[list[Prompt], list[str | None]]:
    """(prompts, the cache salt each prompt dict names) of generate()'s `prompts` argument."""
    if isinstance(prompts, str):
        return [prompts], [None]
    if isinstance(prompts, Mapping) and ("input_ids" in prompts or not VLLM_PROMPT_KEYS & prompts.keys()):
        rows = encoding_token_ids(prompts)
        return rows, [None] * len(rows)
    if isinstance(prompts, (Mapping, torch.Tensor)):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)], [None]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, a 1-D integer tensor, a tokenizer "
                         "output with input_ids, a vLLM prompt dict ({'prompt': ...} or {'prompt_token_ids': "
                         "...}), or a non-empty list of strings, id lists, 1-D tensors or prompt dicts")
    prompt_list, salts = [], []
    for index, prompt in enumerate(prompts):
        salt = None
        if isinstance(prompt, Mapping):
            prompt, salt = prompt_from_dict(prompt, index)
        prompt_list.append(tensor_token_ids(prompt) if isinstance(prompt, torch.Tensor) else prompt)
        salts.append(salt)
    return prompt_list, salts


def _with_prompt_salts(salts: list[str | None], prompt_salts: list[str | None]) -> list[str | None]:
    """generate()'s cache_salt per prompt, with each prompt dict's "cache_salt" (ValueError when they differ)."""
    merged = []
    for index, (salt, own) in enumerate(zip(salts, prompt_salts)):
        if own is not None and salt is not None and own != salt:
            raise ValueError(f"prompt {index}: its dict's cache_salt {own!r} differs from generate()'s "
                             f"cache_salt {salt!r}: give one")
        merged.append(own if own is not None else salt)
    return merged


def _aligned(value, kind: type, n: int, name: str) -> list:
    """`value` (one for all, or a list/tuple with one per prompt; None allowed) as a list of n."""
    if value is None or isinstance(value, kind):
        return [value] * n
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a {kind.__name__}, None, or a list of them, got {type(value).__name__}")
    values = list(value)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} entries for {n} prompts: pass one for all, or one per prompt")
    wrong = next((v for v in values if v is not None and not isinstance(v, kind)), None)
    if wrong is not None:
        raise ValueError(f"{name} entries must be {kind.__name__} or None, got {type(wrong).__name__}")
    return values


def _check_one_source_per_name(requests: list, what: str) -> None:
    """ValueError when one call binds an adapter name to two (path, revision) sources: each
    request would replace the adapter the others use, and the load would repeat."""
    sources: dict[str, tuple] = {}
    for request in requests:
        if request is None:
            continue
        known = sources.setdefault(request.name, request.source)
        if known != request.source:
            raise ValueError(f"{what}: adapter name {request.name!r} is given two sources in one call, "
                             f"{known} and {request.source}: use one name per adapter")
