"""Builds the demo's artifacts offline: a tiny Llama-shaped base model, a word-level tokenizer, a
few tenant LoRA adapters and a prompt-tuning (soft prompt) tenant trained with PEFT, each with its
own recognizable style.

Everything is written as the real libraries write it (``save_pretrained`` of transformers and PEFT),
so the engine reads the same files it would read from the Hub. Artifacts are cached under
``$LORA_RUNNER_DEMO_CACHE``, else ``$XDG_CACHE_HOME/lora-runner/demo``, else
``~/.cache/lora-runner/demo``, in a folder named after the recipe's key, so a changed recipe rebuilds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

RECIPE_VERSION = "demo-v3"  # bump when the corpus or the training code changes

TOPICS = ("sea", "city", "garden", "mountain", "river", "market", "forest", "castle", "island", "road")
# The demo's prompts end in a topic; every answer repeats it, so outputs follow the prompt.
# Prompt template i is always answered with answer i of the model's (or tenant's) style.
PROMPT_TEMPLATES = ("tell me about the {t}", "what do you think of the {t}", "describe the {t}")

# The base model's generic answers (pretraining), then each tenant's style (LoRA training).
BASE_ANSWERS = (
    "the {t} is big and old and many people go there",
    "the {t} is a nice place to visit in the summer",
    "people say the {t} is quiet at night",
)
TENANT_ANSWERS: dict[str, tuple[str, ...]] = {
    "pirate": (
        "arr matey the {t} be full of gold and rum",
        "yo ho ho the {t} be a fine place for a pirate",
        "arr the {t} be where me ship drops anchor",
    ),
    "weather": (
        "the forecast for the {t} is sunny with a light breeze",
        "expect heavy rain over the {t} later today",
        "clouds over the {t} with a chance of snow tonight",
    ),
    "polite": (
        "thank you kindly for asking about the {t} it is truly lovely",
        "what a wonderful question the {t} is delightful thank you",
        "dear friend the {t} is charming and i am grateful you asked",
    ),
    # Not served in the first batch: the demo hot-loads it while other requests run.
    "chef": (
        "stir the {t} slowly and add a pinch of salt",
        "bake the {t} for ten minutes then serve it warm",
        "chop the {t} finely and fry it in butter",
    ),
}
HOT_LOADED_TENANT = "chef"
# Tenants fine-tuned by PEFT prompt tuning: only a soft prompt (a few trained input embeddings put in
# front of the prompt) is learned, the base model stays as it is. Prompt tuning elicits what a base
# model can already do; a 2-layer model learns little else, so, as a large model would from its
# pretraining data, the demo base learns each such style behind a text cue ("sports news tell me about
# the sea"). The soft prompt, trained from random vocabulary embeddings on cue-less prompts, learns
# to stand in for the cue: without it the base answers in its own style.
PROMPT_TENANT_ANSWERS: dict[str, tuple[str, ...]] = {
    "sports": (
        "goal for the {t} team in the last minute and the crowd goes wild",
        "champions again the {t} team lifts the cup",
        "final score at the {t} three to one after a great match",
    ),
}
PROMPT_TENANT_CUES: dict[str, str] = {"sports": "sports news"}
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")


@dataclass(frozen=True)
class Recipe:
    """Sizes and training lengths of the demo; its `key` names the cache folder."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    pretrain_steps: int = 300
    lora_steps: int = 120
    batch_size: int = 32
    lora_rank: int = 8
    tenants: tuple[str, ...] = tuple(TENANT_ANSWERS)
    prompt_tenants: tuple[str, ...] = tuple(PROMPT_TENANT_ANSWERS)
    prompt_steps: int = 120
    num_virtual_tokens: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        for field_name, known in (("tenants", TENANT_ANSWERS), ("prompt_tenants", PROMPT_TENANT_ANSWERS)):
            unknown = set(getattr(self, field_name)) - set(known)
            if unknown:
                raise ValueError(f"unknown demo {field_name} {sorted(unknown)}; known: {sorted(known)}")
        if min(self.pretrain_steps, self.lora_steps, self.prompt_steps, self.batch_size, self.lora_rank,
               self.num_virtual_tokens) <= 0:
            raise ValueError("Recipe steps, batch_size, lora_rank and num_virtual_tokens must be positive")

    @property
    def key(self) -> str:
        """Folder name: the recipe version plus a hash of every field."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{RECIPE_VERSION}-{hashlib.sha256(blob).hexdigest()[:10]}"


@dataclass(frozen=True)
class DemoArtifacts:
    """Where the built demo lives: a transformers model dir and one PEFT dir per tenant
    (`adapters`: LoRAs, `prompt_adapters`: prompt tuning)."""

    base_dir: Path
    adapters: dict[str, Path] = field(default_factory=dict)
    prompt_adapters: dict[str, Path] = field(default_factory=dict)


def default_cache_root() -> Path:
    """The user cache folder for demo artifacts (see module docstring for the lookup order)."""
    if os.environ.get("LORA_RUNNER_DEMO_CACHE"):
        return Path(os.environ["LORA_RUNNER_DEMO_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "lora-runner" / "demo"


def demo_prompts(num: int = len(TOPICS)) -> list[str]:
    """`num` prompts the demo model understands, cycling through templates and topics."""
    if not 0 < num <= len(TOPICS):
        raise ValueError(f"num must be in 1..{len(TOPICS)}, got {num}")
    return [PROMPT_TEMPLATES[i % len(PROMPT_TEMPLATES)].format(t=TOPICS[i]) for i in range(num)]


def build_demo_artifacts(root: str | os.PathLike | None = None, recipe: Recipe = Recipe(),
                         rebuild: bool = False, progress: bool = True) -> DemoArtifacts:
    """Return the cached artifacts for `recipe`, training them first if absent (or if `rebuild`).

    Builds into a temporary sibling folder and renames it into place when complete, so an
    interrupted build never leaves a half-written cache behind.
    """
    final = Path(root) if root is not None else default_cache_root()
    final = final / recipe.key
    if final.exists() and rebuild:
        shutil.rmtree(final)
    if not (final / "DONE").exists():
        tmp = final.with_name(f"{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info("building demo artifacts in %s (first run only)", final)
        threads = torch.get_num_threads()
        # The model is tiny: one thread trains as fast, and cannot thrash when the cores are busy.
        torch.set_num_threads(1)
        try:
            _build(tmp, final, recipe, progress)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(threads)
        (tmp / "DONE").write_text(json.dumps(asdict(recipe)))
        if (final / "DONE").exists():  # a concurrent build finished first: keep its artifacts
            shutil.rmtree(tmp)
        else:
            shutil.rmtree(final, ignore_errors=True)  # a stale folder without DONE
            tmp.rename(final)
    else:
        logger.info("using cached demo artifacts in %s", final)
    return DemoArtifacts(final / "base", {name: final / "adapters" / name for name in recipe.tenants},
                         {name: final / "prompt_adapters" / name for name in recipe.prompt_tenants})


# ----------------------------------------------------------------------------- corpus and tokenizer

def _styles() -> tuple[tuple[str, ...], ...]:
    """Every style's answer templates: the base model's, then each LoRA and prompt-tuning tenant's."""
    return (BASE_ANSWERS, *TENANT_ANSWERS.values(), *PROMPT_TENANT_ANSWERS.values())


def _vocabulary() -> list[str]:
    texts = list(PROMPT_TEMPLATES) + list(PROMPT_TENANT_CUES.values())
    texts += [answer for answers in _styles() for answer in answers]
    words = {w for text in texts for w in text.replace("{t}", "").split()} | set(TOPICS)
    return list(SPECIAL_TOKENS) + sorted(words)


def save_tokenizer(path: Path):
    """A word-level tokenizer over the demo vocabulary, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


def _sentences(tokenizer) -> list[tuple[list[int], int]]:
    """Every style's answers as plain sentences (no prompt), so the base knows all the words."""
    out = []
    for topic in TOPICS:
        for answers in _styles():
            for answer in answers:
                out.append((tokenizer.encode(answer.format(t=topic)) + [tokenizer.eos_token_id], 0))
    return out


def _examples(tokenizer, answers: tuple[str, ...], cue: str = "") -> list[tuple[list[int], int]]:
    """(token ids ending in eos, prompt length) for every topic x (prompt template, its answer);
    `cue` (words) is put in front of every prompt."""
    out = []
    for topic in TOPICS:
        for tpl, answer in zip(PROMPT_TEMPLATES, answers, strict=True):
            prompt = tokenizer.encode(f"{cue} {tpl.format(t=topic)}" if cue else tpl.format(t=topic))
            ids = prompt + tokenizer.encode(answer.format(t=topic)) + [tokenizer.eos_token_id]
            out.append((ids, len(prompt)))
    return out


def _batch(examples, tokenizer, size: int, rng: random.Random, answer_only: bool):
    """A right-padded batch; half the rows start with BOS so serving works with or without one."""
    rows = []
    for ids, prompt_len in rng.choices(examples, k=size):
        bos = [tokenizer.bos_token_id] if rng.random() < 0.5 else []
        rows.append((bos + ids, len(bos) + prompt_len))
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((size, width), tokenizer.pad_token_id)  # [B, S]
    labels = torch.full((size, width), -100)  # [B, S]; -100 = ignored by the loss
    mask = torch.zeros((size, width), dtype=torch.long)  # [B, S]
    for i, (ids, prompt_len) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
        first_label = prompt_len if answer_only else 0
        labels[i, first_label: len(ids)] = input_ids[i, first_label: len(ids)]
    return input_ids, mask, labels


def _train(model, params, examples, tokenizer, recipe: Recipe, steps: int, lr: float,
           answer_only: bool, desc: str, progress: bool, seed: int) -> float:
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / steps)
    model.train()
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for _ in bar:
        input_ids, mask, labels = _batch(examples, tokenizer, recipe.batch_size, rng, answer_only)
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    logger.info("%s: final loss %.3f", desc, loss.item())
    return loss.item()


# ----------------------------------------------------------------------------- build

def _build(tmp: Path, final: Path, recipe: Recipe, progress: bool) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(recipe.seed)
    tokenizer = save_tokenizer(tmp / "base")
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads, num_key_value_heads=recipe.num_kv_heads,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    base = LlamaForCausalLM(config)
    base.name_or_path = str(final / "base")  # recorded as base_model_name_or_path by PEFT
    # Prompted base answers, upweighted x4 against generic sentences in every style, and the
    # prompt-tuning tenants' styles behind their text cues (see PROMPT_TENANT_CUES).
    corpus = 4 * _examples(tokenizer, BASE_ANSWERS) + _sentences(tokenizer)
    for name in recipe.prompt_tenants:
        corpus += _examples(tokenizer, PROMPT_TENANT_ANSWERS[name], cue=PROMPT_TENANT_CUES[name])
    _train(base, base.parameters(), corpus, tokenizer, recipe,
           recipe.pretrain_steps, 3e-3, answer_only=False, desc="pretrain base", progress=progress,
           seed=recipe.seed)
    base.save_pretrained(str(tmp / "base"))

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for index, name in enumerate(recipe.tenants):
        torch.manual_seed(recipe.seed + 1 + index)
        lora_config = LoraConfig(r=recipe.lora_rank, lora_alpha=2 * recipe.lora_rank,
                                 target_modules=targets, lora_dropout=0.0)
        peft_model = get_peft_model(copy.deepcopy(base), lora_config)
        trainable = [p for p in peft_model.parameters() if p.requires_grad]
        _train(peft_model, trainable, _examples(tokenizer, TENANT_ANSWERS[name]), tokenizer, recipe,
               recipe.lora_steps, 1e-2, answer_only=True, desc=f"train LoRA {name!r}",
               progress=progress, seed=recipe.seed + 1 + index)
        peft_model.save_pretrained(str(tmp / "adapters" / name), save_embedding_layers=False)

    for index, name in enumerate(recipe.prompt_tenants):
        _train_prompt_tenant(base, name, tmp / "prompt_adapters" / name, tokenizer, recipe,
                             seed=recipe.seed + 1 + len(recipe.tenants) + index, progress=progress)


def _train_prompt_tenant(base, name: str, path: Path, tokenizer, recipe: Recipe, seed: int,
                         progress: bool) -> None:
    """Prompt-tune `base` on tenant `name`'s style and save the soft prompt with PEFT's save_pretrained.

    The soft prompt [num_virtual_tokens, hidden] starts as the embeddings of randomly sampled
    vocabulary words and is the only thing trained, on the tenant's answers to cue-less prompts.
    """
    from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model

    torch.manual_seed(seed)
    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=recipe.num_virtual_tokens,
                                prompt_tuning_init=PromptTuningInit.SAMPLE_VOCAB)
    peft_model = get_peft_model(copy.deepcopy(base), config)
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    _train(peft_model, trainable, _examples(tokenizer, PROMPT_TENANT_ANSWERS[name]), tokenizer, recipe,
           recipe.prompt_steps, 3e-2, answer_only=True, desc=f"prompt-tune {name!r}",
           progress=progress, seed=seed)
    peft_model.save_pretrained(str(path), save_embedding_layers=False)
