"""Per-request sampling settings: checked when built, and again (with the engine's limits) when a
request is added, on a private copy, since a caller may change the fields in between."""

from __future__ import annotations

import copy
import enum
from dataclasses import InitVar, dataclass, field

from lora_runner.sampling_checks import (MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_COUNT, MAX_LOGIT_BIAS,
                                         check_logprob_counts, check_token_filters)
from lora_runner.sampling_checks import check_real as _check_real
from lora_runner.sampling_checks import is_int as _is_int
from lora_runner.structured_outputs_params import (GuidedDecodingParams, StructuredOutputsParams,
                                                   as_structured_outputs)

__all__ = ["SamplingParams", "RequestOutputKind", "StructuredOutputsParams", "GuidedDecodingParams"]

MAX_STOP_TOKEN_IDS = 1024  # most stop_token_ids one request may give (each is checked every token)
MAX_N = 16  # most parallel samples (SamplingParams.n) of one prompt
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY], as in OpenAI's API
MAX_STOP_STRINGS = 64  # most stop strings one request may give (each is searched every step)
MAX_STOP_STRING_CHARS = 256  # longest stop string (streamed text is held back by its length - 1)
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample by argmax, as in vLLM (no 1/T overflow)
# repetition_penalty lies in [1/MAX_REPETITION_PENALTY, MAX_REPETITION_PENALTY]: a logit of float32's range
# scaled by it stays finite (1e300 would turn the logits into inf and NaN)
MAX_REPETITION_PENALTY = 100.0
MAX_TEMPERATURE = 100.0  # above it every token is (nearly) equally likely: nothing more to ask for
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
# vLLM's SamplingParams options with no counterpart here: the values that ask for nothing, and why others cannot be
VLLM_ONLY_OPTIONS = {
    "best_of": ((None, 1), "best-of-n is not implemented: use n and pick by cumulative_logprob"),
    "detokenize": ((True, False), "it must be True or False"),  # the text is always detokenized (it costs little)
    "logits_processors": ((None,), "custom logits processors are not supported: allowed_token_ids, bad_words and "
                          "structured_outputs cover the common uses"),
    "extra_args": ((None,), "there are no custom sampling extensions to read them"),
}


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (vLLM's names). CUMULATIVE: everything generated
    so far (token ids, text, logprobs). DELTA: only what is new since the request's previous output
    (``RequestOutput.add`` joins deltas back into the cumulative form)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"


@dataclass
class SamplingParams:
    """How to pick each generated token of one request.

    temperature: in [0, 100] (MAX_TEMPERATURE); below 1e-5 (GREEDY_TEMPERATURE; 0 included) means
    greedy (argmax); otherwise logits are divided by it before sampling. Counts (top_k, max_tokens,
    min_tokens, logprobs) and stop token ids are at most MAX_COUNT (2**31 - 1); every number must be
    finite, so a tenant's value can never turn the logits into NaN.
    top_k: keep the k most likely tokens (-1 or None: off).
    top_p: nucleus mass in (0, 1]. min_p: in [0, 1]; tokens less likely than min_p times the most
    likely one (after temperature) are not sampled (0: off), as vLLM. seed: per-request seed; the same
    seed and prompt give the same
    tokens whatever else is batched. max_tokens: most tokens to generate. stop_token_ids: a list of
    at most MAX_STOP_TOKEN_IDS (1024) extra ids that end generation (kept in the output); None at
    construction means none. ignore_eos: keep going past the model's EOS ids. logprobs: k >= 0 to
    return, per generated token, a dict token_id -> logprob of the k most likely tokens plus the
    chosen one (raw model log-probabilities: log_softmax of the float32 logits, before
    temperature/top-k/top-p and logit_bias); -1: every token of the vocabulary (vLLM's); the engine
    caps k at its max_logprobs setting (-1 there: no cap), counting -1 as the vocabulary size.
    presence_penalty / frequency_penalty: numbers in [-2, 2] (OpenAI's semantics): each token's
    logit drops by presence_penalty if it occurs among this request's generated tokens, plus
    frequency_penalty times how often it does. repetition_penalty: a number in [0.01, 100]
    (MAX_REPETITION_PENALTY; 1 = off; HF's and vLLM's semantics):
    a token that occurs in the prompt or the generated tokens has its logit
    divided by it when positive, multiplied by it otherwise. Logprobs stay the raw model ones.
    n: how many samples of the prompt to generate, 1..MAX_N (16); sample i uses seed + i (mod 2**64,
    when seed is set), so it equals a single request with that seed.
    stop: strings (a str or a list of at most MAX_STOP_STRINGS, each 1..MAX_STOP_STRING_CHARS
    characters) that end generation as soon as the output text contains one (the first to be
    completed wins); the text is cut before it, or after it with include_stop_str_in_output=True.
    While stop strings are set, streamed text lags by the longest one's length - 1 characters.
    min_tokens: no EOS, stop token or stop string ends the request before this many tokens (at most
    max_tokens): until then the EOS ids (unless ignore_eos) and stop_token_ids are masked from
    sampling (as in vLLM) and stop strings are not searched.
    truncate_prompt_tokens: keep only the prompt's last k tokens (k >= 1; -1: max_model_len; None: the
    whole prompt, which must fit), as vLLM.
    prompt_logprobs: k >= 0 to return, per prompt position after the first, a dict token_id -> logprob
    of the k most likely tokens there plus the actual prompt token (vLLM's RequestOutput.prompt_logprobs,
    whose first entry is None); -1 and the max_logprobs cap as for logprobs. Every prompt position is computed
    for it: the prefix cache does not serve such a request's prompt.
    skip_special_tokens: leave special tokens (EOS, chat markers) out of the output text (vLLM's default
    True). spaces_between_special_tokens: with skip_special_tokens=False, put a space between a special
    token and the text next to it, as vLLM (default True).
    structured_outputs: a StructuredOutputsParams (json schema, json_object, regex, choice or grammar) the
    output must satisfy, as vLLM; None: unconstrained. The output ends ("stop") once the constraint is
    complete and the model picks an end token (lora_runner.engine.structured).
    allowed_token_ids: a non-empty list of at most MAX_ALLOWED_TOKEN_IDS ids: only these may be sampled
    (None: any), as vLLM. bad_words: at most MAX_BAD_WORDS (256) non-empty strings of at most
    MAX_BAD_WORD_CHARS characters, never generated (vLLM's semantics: each word's token sequences, with and
    without a leading space; the last token of a sequence is banned while the tokens before it end the
    output so far). logit_bias: a dict token id -> a number in [-100, 100] added to that token's logit before
    the penalties and sampling (OpenAI's and vLLM's; at most MAX_LOGIT_BIAS entries; the logprobs stay the
    raw model's). All three are checked with the engine's vocabulary at add_request.
    output_kind: RequestOutputKind.CUMULATIVE (each output holds everything so far) or DELTA (each
    holds only what is new since the previous one).
    guided_decoding (vLLM's older spelling, read at construction only): a GuidedDecodingParams (or a dict of
    its fields) that becomes structured_outputs; ValueError when both are given. vLLM's best_of (1 or None),
    detokenize (the text is always detokenized), logits_processors and extra_args (None) are accepted only
    where they ask for nothing (VLLM_ONLY_OPTIONS); any other value is a ValueError naming the option.

    Raises ValueError naming the field for a wrong type or an out-of-range value (``bool`` is not
    an integer). ``LLMEngine.add_request`` checks a copy again with the engine's limits (see
    ``validate``), so a field changed after construction is caught there and later changes to this
    object do not reach a running request.
    """

    temperature: float = 1.0
    top_k: int | None = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # penalties (lora_runner.sample.sampler applies them before temperature/top-k/top-p)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1  # parallel samples of the prompt, sharing its prefill (see LLMEngine.add_request)
    logprobs: int | None = None
    # stop strings and min_tokens (lora_runner.engine.detokenizer, lora_runner.engine.output_processor)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    truncate_prompt_tokens: int | None = None
    # prompt logprobs (lora_runner.sample.prompt_logprobs) and the output text's special tokens (detokenizer)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # the constraint the output must satisfy (lora_runner.structured_outputs_params); None: unconstrained
    structured_outputs: StructuredOutputsParams | None = None
    allowed_token_ids: list[int] | None = None  # only these ids may be sampled; None: any
    bad_words: list[str] | None = None  # words never generated (vLLM's semantics, see the docstring)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (lora_runner.sample.token_masks)
    # the token sequences of bad_words, set by the engine at add_request (its tokenizer); None: not yet
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)
    # CUMULATIVE (the whole output so far in every RequestOutput) or DELTA (only the new part)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's older name of structured_outputs (a GuidedDecodingParams), turned into it by __post_init__
    guided_decoding: InitVar[GuidedDecodingParams | StructuredOutputsParams | dict | None] = None
    # vLLM options without a counterpart, read at construction only (VLLM_ONLY_OPTIONS)
    best_of: InitVar[int | None] = None
    detokenize: InitVar[bool] = True
    logits_processors: InitVar[list | None] = None
    extra_args: InitVar[dict | None] = None

    def __post_init__(self, guided_decoding=None, best_of=None, detokenize=True, logits_processors=None,
                      extra_args=None) -> None:
        for name, value in (("best_of", best_of), ("detokenize", detokenize),
                            ("logits_processors", logits_processors), ("extra_args", extra_args)):
            honoured, reason = VLLM_ONLY_OPTIONS[name]
            if not any(value is v or _is_int(value) and value == v for v in honoured):
                raise ValueError(f"SamplingParams({name}={value!r}) is not supported: {reason}")
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("pass structured_outputs or guided_decoding (vLLM's older name), not both")
            self.structured_outputs = as_structured_outputs(guided_decoding)
        if self.top_k is None:
            self.top_k = -1
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.stop_token_ids = _copied_token_list(self.stop_token_ids)
        self.stop = _stop_list(self.stop)
        self._copy_lists()
        self.validate()

    def validate(self, max_logprobs: int | None = None, vocab_size: int | None = None) -> None:
        """Check every field; ValueError naming the field.

        max_logprobs: the most logprobs a request may ask for (None or -1: no cap). vocab_size: token ids
        (stop_token_ids, allowed_token_ids, logit_bias) must lie in [0, vocab_size), and logprobs may not
        exceed it, -1 counting as it (None: no check).
        """
        _check_real("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}] (below 1e-5 = greedy)")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # False for NaN too
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}] (below 1e-5 = greedy), "
                             f"got {self.temperature}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1) or self.top_k > MAX_COUNT:
            raise ValueError(f"top_k must be -1 or None (off) or an integer in [1, {MAX_COUNT}], got {self.top_k!r}")
        _check_real("top_p", self.top_p, "a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_real("min_p", self.min_p, "a number in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not (_is_int(self.seed) and _SEED_RANGE[0] <= self.seed < _SEED_RANGE[1]):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT:
            raise ValueError(f"max_tokens must be an integer in [1, {MAX_COUNT}], got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise ValueError("structured_outputs must be a StructuredOutputsParams or None, "
                                 f"got {type(self.structured_outputs).__name__}")
            self.structured_outputs.validate()
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._validate_penalties()
        self._validate_stop_token_ids(vocab_size)
        self._validate_logprobs(max_logprobs, vocab_size)
        self._validate_stop_strings()
        check_token_filters(self, vocab_size)

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_real(name, value, "a number in [-2, 2]")
            if not -MAX_PENALTY <= value <= MAX_PENALTY:  # False for NaN too
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        what = f"a number in [{1 / MAX_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)"
        _check_real("repetition_penalty", self.repetition_penalty, what)
        if not 1 / MAX_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:  # False for NaN
            raise ValueError(f"repetition_penalty must be {what}, got {self.repetition_penalty}")

    def sample_params(self, index: int) -> SamplingParams:
        """The params of parallel sample `index` (0..n-1): n=1 and, with a seed, seed + index
        (wrapped into [0, 2**64) past the top), so each sample equals a single request with it."""
        params = self.clone()
        params.n = 1
        if index:  # sample 0's prompt logprobs are the request's: the others share its prompt
            params.prompt_logprobs = None
        if self.seed is not None and index:
            seed = self.seed + index
            params.seed = seed - 2**64 if seed >= 2**64 else seed
        return params

    @property
    def has_penalties(self) -> bool:
        """True when a presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def _validate_stop_token_ids(self, vocab_size: int | None) -> None:
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(ids)} entries, more than the limit of {MAX_STOP_TOKEN_IDS}")
        if any(not _is_int(t) or not 0 <= t <= MAX_COUNT for t in ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_COUNT}], got {list(ids)!r:.200}")
        if vocab_size is not None and any(t >= vocab_size for t in ids):
            raise ValueError(f"stop_token_ids must lie in [0, {vocab_size}) (the model's vocabulary), "
                             f"got {max(ids)}")

    def _validate_logprobs(self, max_logprobs: int | None, vocab_size: int | None) -> None:
        for name in ("skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_logprob_counts(self, max_logprobs, vocab_size)

    def _validate_stop_strings(self) -> None:
        stop = self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop has {len(stop)} entries, more than the limit of {MAX_STOP_STRINGS}")
        for s in stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_STRING_CHARS:
                raise ValueError(f"stop must hold non-empty strings of at most {MAX_STOP_STRING_CHARS} "
                                 f"characters, got {s!r:.80}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, "
                             f"got {self.include_stop_str_in_output!r}")
        if self.truncate_prompt_tokens is not None and not (
                _is_int(self.truncate_prompt_tokens) and (self.truncate_prompt_tokens == -1
                                                          or 1 <= self.truncate_prompt_tokens <= MAX_COUNT)):
            raise ValueError(f"truncate_prompt_tokens must be -1 (max_model_len), an integer in [1, {MAX_COUNT}] "
                             f"or None, got {self.truncate_prompt_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")

    @property
    def stop_text_holdback(self) -> int:
        """Characters of output text held back from streaming: a stop string may still complete there
        and cut them (0 without stop strings, or when the stop string is kept in the output)."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        """A copy that shares nothing mutable with this object (stop_token_ids, stop, allowed_token_ids,
        bad_words, logit_bias and structured_outputs are copied).

        Not validated: call ``validate`` on the copy. An over-long stop_token_ids is not copied
        (validate rejects it), so cloning stays cheap whatever the caller put there.
        """
        params = copy.copy(self)
        if params.top_k is None:
            params.top_k = -1
        params.stop_token_ids = _copied_token_list(params.stop_token_ids)
        params.stop = _stop_list(params.stop)
        params._copy_lists()
        return params

    def _copy_lists(self) -> None:
        """Own copies of the list fields and of structured_outputs, so a caller's later change of its
        objects never reaches a running request (over-long lists are left for validate to refuse)."""
        if isinstance(self.allowed_token_ids, (list, tuple)) and len(self.allowed_token_ids) <= MAX_ALLOWED_TOKEN_IDS:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (list, tuple)) and len(self.bad_words) <= MAX_BAD_WORDS:
            self.bad_words = list(self.bad_words)
        if isinstance(self.logit_bias, dict) and len(self.logit_bias) <= MAX_LOGIT_BIAS:
            self.logit_bias = dict(self.logit_bias)
        if isinstance(self.structured_outputs, StructuredOutputsParams):
            self.structured_outputs = self.structured_outputs.copy()

    @property
    def greedy(self) -> bool:
        """True when tokens are picked by argmax (temperature below GREEDY_TEMPERATURE)."""
        return self.temperature < GREEDY_TEMPERATURE


def _copied_token_list(ids):
    """A fresh list of ``ids`` when it is a list/tuple short enough to be valid; else ``ids`` itself."""
    if isinstance(ids, (list, tuple)) and len(ids) <= MAX_STOP_TOKEN_IDS:
        return list(ids)
    return ids


def _stop_list(stop):
    """stop as a fresh list: None -> [], a str -> [str]; anything else invalid is left for validate."""
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, (list, tuple)) and len(stop) <= MAX_STOP_STRINGS:
        return list(stop)
    return stop
