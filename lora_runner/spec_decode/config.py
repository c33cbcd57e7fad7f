"""SpeculativeConfig: EngineConfig.speculative_config (vLLM's spelling) read and checked once.

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``
  proposes up to k tokens per decode step from the request's own prompt and output (n-gram prompt
  lookup, lora_runner.spec_decode.ngram). As in vLLM, when only one of the lookup bounds is given the
  other takes its value, and when neither is given both are 5.
- ``{"method": "draft_model", "model": PATH_OR_HUB_ID, "num_speculative_tokens": k}`` proposes the
  greedy tokens of a second, smaller model with the target's tokenizer (lora_runner.spec_decode.
  draft_model); whether its vocabulary matches is checked when the engine loads it. A request's
  ``LoRARequest(..., draft_lora_path=PATH)`` runs the draft with that adapter (spec_decode.draft_adapters);
  ours, ``"max_draft_loras": n`` (default: the engine's max_loras): the draft model's LoRA device slots.

Other vLLM methods (eagle, medusa, ...) are refused.

Adaptation (lora_runner.spec_decode.adaptive), for every method: ``"disable_by_batch_size": n``
(vLLM's key) turns speculation off in steps where more than n running requests decode; ours,
``"min_acceptance_rate": r`` (default 0.1, 0 turns it off) and ``"acceptance_probe_interval": m``
(default 8): a request whose recent acceptance rate (an exponential moving average of accepted /
proposed drafts per verify step) is below r stops proposing, and proposes again once every m of its
decode steps to measure it anew.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
_NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp")
_ADAPTATION = {"disable_by_batch_size", "min_acceptance_rate", "acceptance_probe_interval"}
_KEYS = {"ngram": {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", *_ADAPTATION},
         "draft_model": {"method", "num_speculative_tokens", "model", "max_draft_loras", *_ADAPTATION}}
_DEFAULT_LOOKUP = 5  # vLLM's n-gram size when neither bound is set
DEFAULT_MIN_ACCEPTANCE_RATE = 0.1
DEFAULT_PROBE_INTERVAL = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative-decoding setting (see the module docstring)."""

    method: str
    num_speculative_tokens: int  # k: most draft tokens verified per sequence and step
    prompt_lookup_min: int | None  # smallest n-gram matched ("ngram" only, else None)
    prompt_lookup_max: int | None  # largest n-gram matched, tried first ("ngram" only, else None)
    model: str | None = None  # the draft model's local dir or Hub repo id ("draft_model" only, else None)
    disable_by_batch_size: int | None = None  # no speculation in steps with more decoding requests; None: never
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE  # a request's acceptance EMA below it: it pauses
    acceptance_probe_interval: int = DEFAULT_PROBE_INTERVAL  # a paused request speculates once per this many steps
    max_draft_loras: int | None = None  # the draft model's LoRA slots ("draft_model" only); None: max_loras

    @classmethod
    def parse(cls, value: Mapping | str) -> SpeculativeConfig:
        """The config of a dict or its JSON text; ValueError with what to change otherwise."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config must be a JSON object, got {value!r}: {error}") from None
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {value!r}")
        method = value.get("method")
        if method in _NOT_YET:
            raise ValueError(f"speculative_config method {method!r} is not supported yet; use one of {METHODS}")
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        unknown = set(value) - _KEYS[method]
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {sorted(unknown)} for method {method!r} "
                             f"(known: {sorted(_KEYS[method])})")
        k = value.get("num_speculative_tokens")
        _check_count("num_speculative_tokens", k)
        if method == "draft_model":
            model = value.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError(f'speculative_config method "draft_model" needs "model": the draft model\'s '
                                 f"local directory or Hub repo id, got {model!r}")
            slots = value.get("max_draft_loras")
            if slots is not None:
                _check_count("max_draft_loras", slots)
            return cls(method, k, None, None, model, *_adaptation(value), max_draft_loras=slots)
        low, high = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = _DEFAULT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        _check_count("prompt_lookup_min", low)
        _check_count("prompt_lookup_max", high)
        if low > high:
            raise ValueError(f"speculative_config prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})")
        return cls(method, k, low, high, None, *_adaptation(value))


def _adaptation(value: Mapping) -> tuple[int | None, float, int]:
    """The adaptation keys of a speculative_config (see the module docstring), checked."""
    batch = value.get("disable_by_batch_size")
    rate = value.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE)
    interval = value.get("acceptance_probe_interval", DEFAULT_PROBE_INTERVAL)
    if batch is not None and (not isinstance(batch, int) or isinstance(batch, bool) or batch < 1):
        raise ValueError(f"speculative_config disable_by_batch_size must be an integer >= 1 or null, got {batch!r}")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate <= 1:
        raise ValueError(f"speculative_config min_acceptance_rate must be a number in [0, 1], got {rate!r}")
    if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
        raise ValueError(f"speculative_config acceptance_probe_interval must be an integer >= 1, got {interval!r}")
    return batch, float(rate), interval


def _check_count(name: str, number) -> None:
    if not isinstance(number, int) or isinstance(number, bool) or number < 1:
        raise ValueError(f"speculative_config {name} must be an integer >= 1, got {number!r}")
