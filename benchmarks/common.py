"""Shared pieces of the engine benchmark: seeded workloads, random models and adapters, statistics.

Workloads follow Punica and S-LoRA: prompt and output lengths drawn from a fixed seed, adapter
popularity "distinct" (round-robin, every adapter equally often), "uniform" (random) or "zipf"
(probability of the k-th most popular adapter proportional to k^-1.5), requests arriving all at
once ("batch") or as a Poisson process ("poisson").
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

POPULARITIES = ("distinct", "uniform", "zipf")
ARRIVALS = ("batch", "poisson")
ZIPF_EXPONENT = 1.5
FIRST_ORDINARY_TOKEN = 4  # ids below are the tokenizer's specials (pad, bos, eos, unk)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class WorkloadSpec:
    """One benchmark workload: how many requests, which adapters they use, and when they arrive."""

    num_requests: int
    num_adapters: int  # 0: every request uses the base model
    popularity: str = "uniform"
    arrival: str = "batch"
    rate: float = 8.0  # requests per second, for Poisson arrivals
    max_loras: int = 8  # device slots of the engine serving it
    prompt_len: tuple[int, int] = (16, 64)  # inclusive range
    output_len: tuple[int, int] = (8, 32)  # inclusive range
    seed: int = 0
    shared_prefix_len: int = 0  # > 0: each adapter's (tenant's) prompts start with its own fixed system prompt

    def __post_init__(self) -> None:
        if self.popularity not in POPULARITIES:
            raise ValueError(f"popularity must be one of {POPULARITIES}, got {self.popularity!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.num_requests < 1 or self.num_adapters < 0 or self.max_loras < 1 or self.rate <= 0 or \
                self.shared_prefix_len < 0:
            raise ValueError("num_requests, max_loras and rate must be positive, num_adapters and "
                             "shared_prefix_len >= 0")
        for lo, hi in (self.prompt_len, self.output_len):
            if not 1 <= lo <= hi:
                raise ValueError(f"length range must satisfy 1 <= lo <= hi, got {(lo, hi)}")

    @property
    def name(self) -> str:
        """Short label used in tables, e.g. 'batch n=8 distinct'."""
        shared = f" shared={self.shared_prefix_len}" if self.shared_prefix_len else ""
        if self.num_adapters == 0:
            return f"{self.arrival} base{shared}"
        return f"{self.arrival} n={self.num_adapters} {self.popularity}{shared}"


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload; `adapter` indexes the benchmark's adapter list (None: base)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    adapter: int | None
    arrival_s: float  # seconds after the workload starts


def adapter_choices(num_requests: int, num_adapters: int, popularity: str,
                    rng: np.random.Generator) -> list[int]:
    """Adapter index of each request under the given popularity law."""
    if popularity == "distinct":
        return [i % num_adapters for i in range(num_requests)]
    if popularity == "uniform":
        return rng.integers(0, num_adapters, size=num_requests).tolist()
    weights = 1.0 / np.arange(1, num_adapters + 1) ** ZIPF_EXPONENT  # [num_adapters]
    return rng.choice(num_adapters, size=num_requests, p=weights / weights.sum()).tolist()


# the base model's tenant in seed sequences (which take no negative entries): above every adapter index
_BASE_TENANT = 2**32 - 1


def make_workload(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The requests of `spec`, identical on every call with the same spec and vocabulary."""
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size must exceed {FIRST_ORDINARY_TOKEN}, got {vocab_size}")
    rng = np.random.default_rng(spec.seed)
    n = spec.num_requests
    prompt_lens = rng.integers(spec.prompt_len[0], spec.prompt_len[1] + 1, size=n)  # [n]
    output_lens = rng.integers(spec.output_len[0], spec.output_len[1] + 1, size=n)  # [n]
    if spec.arrival == "poisson":
        arrivals = np.cumsum(rng.exponential(1.0 / spec.rate, size=n))  # [n] seconds
        arrivals -= arrivals[0]  # the first request opens the run
    else:
        arrivals = np.zeros(n)
    adapters = (adapter_choices(n, spec.num_adapters, spec.popularity, rng)
                if spec.num_adapters else [None] * n)
    # one system prompt per tenant (adapter; the base model is one more tenant), drawn from its own seed so
    # that the rest of the workload does not change with shared_prefix_len
    system = {a: np.random.default_rng([spec.seed, _BASE_TENANT if a is None else a]).integers(
        FIRST_ORDINARY_TOKEN, vocab_size, size=spec.shared_prefix_len) for a in set(adapters)}
    requests = []
    for i in range(n):
        prompt = rng.integers(FIRST_ORDINARY_TOKEN, vocab_size, size=int(prompt_lens[i]))
        prompt = np.concatenate([system[adapters[i]], prompt])  # [shared_prefix_len + prompt_len]
        requests.append(BenchRequest(f"req-{i}", tuple(int(t) for t in prompt), int(output_lens[i]),
                                     adapters[i], float(arrivals[i])))
    return requests


# ----------------------------------------------------------------------------- models and adapters

@dataclass(frozen=True)
class ModelShape:
    """A Llama-shaped random model for benchmarking."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096


def save_random_model(path: Path, shape: ModelShape, seed: int = 0, initializer_range: float = 0.02,
                      dtype: torch.dtype = torch.float32):
    """Write a random LlamaForCausalLM (safetensors, `dtype`) and a word-level tokenizer; returns
    the model. A larger initializer_range gives peakier logits (fewer near-ties in greedy decoding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=shape.tie_word_embeddings,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=initializer_range,
    )
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a 7B model never exists in fp32 on the host
    try:
        model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    model.save_pretrained(str(path))
    save_word_tokenizer(path, shape.vocab_size)
    logger.info("random model %s: %.1fM parameters", shape, model.num_parameters() / 1e6)
    return model


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """Write a word-level tokenizer ("w4" ... "w{vocab_size-1}" after the four specials) beside a model."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<s>", "</s>", "<unk>"])}
    vocab.update({f"w{i}": i for i in range(FIRST_ORDINARY_TOKEN, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


def save_random_adapters(base_model, root: Path, num: int, rank: int, seed: int = 0,
                         progress: bool = True) -> list[Path]:
    """Write `num` PEFT LoRA adapters with random A and B (all linear projections) via PEFT.

    PEFT injects its layers into `base_model` in place: pass a model you no longer need."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS),
                        lora_dropout=0.0, init_lora_weights=False)
    peft_model = get_peft_model(base_model, config)
    lora_params = [(name, p) for name, p in peft_model.named_parameters() if "lora_" in name]
    gen = torch.Generator().manual_seed(seed)
    paths = []
    for i in tqdm(range(num), desc="write adapters", disable=not progress):
        with torch.no_grad():
            for name, param in lora_params:
                # A ~ N(0, 1/in) keeps A x at unit scale; a small B keeps the delta a perturbation
                std = param.shape[1] ** -0.5 if "lora_A" in name else 0.02
                param.copy_(torch.randn(param.shape, generator=gen) * std)  # fp32 draw, cast
        path = root / f"adapter-{i:03d}"
        peft_model.save_pretrained(str(path), save_embedding_layers=False)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------- the PEFT baseline

class PeftRunner:
    """The baseline: PEFT mixed-adapter batches (generate(adapter_names=...)) on static batches;
    plain transformers generate() while no adapter is loaded (workloads without adapters)."""

    def __init__(self, model_dir: str, adapter_paths: list[Path], device: torch.device,
                 dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device, self.paths, self.model, self.loaded = device, adapter_paths, None, set()

    def _load(self, indices: set[int]) -> None:
        """Load adapters before timing: PEFT has no paging, a user loads what the batch needs."""
        from peft import PeftModel

        for i in sorted(indices - self.loaded):
            if self.model is None:
                self.model = PeftModel.from_pretrained(self.base, str(self.paths[i]), adapter_name=f"a{i}")
            else:
                self.model.load_adapter(str(self.paths[i]), adapter_name=f"a{i}")
            self.loaded.add(i)
        if self.model is not None:
            self.model.eval()

    def _generate(self, batch, start: float) -> tuple[float, list[list[int]]]:
        """One static batch; returns the time (since `start`) its first token was ready, and each
        request's requested tokens."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class FirstToken(StoppingCriteria):
            seen: float | None = None

            def __call__(self, input_ids, scores, **kwargs):
                self.seen = self.seen or time.perf_counter() - start
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S], left padded
        mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S]
        for row, r in enumerate(batch):
            input_ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        names = [f"a{r.adapter}" if r.adapter is not None else "__base__" for r in batch]
        model, extra = (self.base, {}) if self.model is None else (self.model, {"adapter_names": names})
        max_new = max(r.max_tokens for r in batch)
        timer = FirstToken()
        with torch.no_grad():
            out = model.generate(input_ids.to(self.device), attention_mask=mask.to(self.device),
                                max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                                pad_token_id=0, **extra,
                                stopping_criteria=StoppingCriteriaList([timer]))  # [B, width + max_new]
        return timer.seen, [out[row, width: width + r.max_tokens].tolist() for row, r in enumerate(batch)]

    def run(self, requests, desc: str) -> dict:
        """Serve `requests` in waves: each batch holds every request that arrived while idle."""
        self._load({r.adapter for r in requests if r.adapter is not None})
        pending = deque(sorted(requests, key=lambda r: r.arrival_s))
        ttfts, token_ids = [], {}
        bar = tqdm(total=sum(r.max_tokens for r in requests), desc=desc, leave=False, unit="tok")
        start, cpu_start = time.perf_counter(), time.process_time()
        while pending:
            now = time.perf_counter() - start
            if pending[0].arrival_s > now:
                time.sleep(pending[0].arrival_s - now)
                now = time.perf_counter() - start
            batch = []
            while pending and pending[0].arrival_s <= now:
                batch.append(pending.popleft())
            first, outputs = self._generate(batch, start)
            ttfts += [first - r.arrival_s for r in batch]
            token_ids.update({r.request_id: ids for r, ids in zip(batch, outputs)})
            bar.update(sum(r.max_tokens for r in batch))
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        bar.close()
        return {"tokens": sum(map(len, token_ids.values())), "seconds": seconds, "cpu_seconds": cpu_seconds,
                "ttfts": ttfts,
                "token_ids": token_ids}


# ----------------------------------------------------------------------------- statistics

def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, NaN when empty."""
    return float(np.percentile(values, q)) if values else float("nan")


def machine_description(device: str) -> dict:
    """What the numbers were measured on."""
    info = {"platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "device": device, "cpu": platform.processor() or "unknown",
            "num_threads": torch.get_num_threads()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def start_cpu_run(threads: int) -> float:
    """The start of a CPU benchmark's main: INFO logs with times, torch on `threads` threads; returns
    the start time (time.perf_counter) the report's "seconds" count from."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    return time.perf_counter()


def write_report(report: dict, out_dir: str | Path, name: str) -> Path:
    """Write `report` as indented JSON to out_dir/<name>-<YYYYmmdd-HHMMSS>.json (out_dir made when
    missing; values JSON cannot hold written as their str); returns the file's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Rows as a markdown table; columns are (key, header, format spec)."""
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("n/a" if value is None or value != value else format(value, fmt))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
