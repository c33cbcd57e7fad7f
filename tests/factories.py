"""Builders for tiny real checkpoints: transformers base models and PEFT adapters saved by PEFT.

Everything is written to disk exactly as the real libraries write it, so the code under test reads
the same files a user would give it. No network.
"""

from __future__ import annotations

import copy
import types
from pathlib import Path

import torch

ARCHS = ("llama", "mistral", "qwen2")


def tiny_config(arch: str = "llama", **overrides):
    """A small transformers config; initializer_range is large so logits are far from uniform."""
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "gemma2": Gemma2Config, "phi3": Phi3Config}[arch]
    kwargs = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        initializer_range=0.2, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


# The smallest Llama the adapter-churn tests need: loads and slot writes cost next to nothing.
MICRO_LLAMA = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1)


def build_tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random transformers causal LM in fp32 eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    return model.eval()


def save_tiny_model(path, arch: str = "llama", seed: int = 0, tokenizer: bool = True,
                    max_shard_size=None, **overrides):
    """Build and save a tiny model (config.json + safetensors) to `path`; returns the model."""
    model = build_tiny_model(arch, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    if tokenizer:
        save_tiny_tokenizer(path, model.config.vocab_size)
    return model


def save_tiny_tokenizer(path, vocab_size: int = 256):
    """A word-level tokenizer (lowercase words, unknown -> <unk>) saved in transformers format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = ["the", "a", "cat", "dog", "sat", "on", "mat", "is", "and", "hello", "world", "tenant",
             "says", "yes", "no", "red", "blue", "green", "one", "two", "three", "i", "you", "we"]
    words += [f"w{i}" for i in range(vocab_size - len(specials) - len(words))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(path))
    return fast


# A ChatML-like template that writes BOS itself (as Llama-3's and many others do), so tokenizing its
# rendering with the tokenizer's own special tokens would give a second BOS.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ message['role'] }} says {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant says {% endif %}"
)


def save_tiny_chat_tokenizer(path, vocab_size: int = 256, chat_template: str | None = TINY_CHAT_TEMPLATE):
    """A word-level tokenizer that adds BOS when encoding (like Llama's), with a chat template that
    writes BOS too; role words are in its vocabulary. Saved in transformers format."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = ["system", "user", "assistant", "says", "the", "a", "cat", "dog", "sat", "on", "mat", "is",
             "hello", "world", "what", "who", "are", "you", "be", "brief", "tell", "me", "story", "yes", "no"]
    words += [f"w{i}" for i in range(vocab_size - len(specials) - len(words))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    return fast


def _random_lora_weights(peft_model, seed: int, scale: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)


def save_lora(base_model, path, seed: int = 0, r: int = 8, lora_alpha: float = 16,
              target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
              scale: float = 0.3, **lora_kwargs):
    """Write a PEFT LoRA with random non-zero A and B via PEFT's save_pretrained; returns the PeftModel.

    The base model is deep-copied, so it is left untouched.
    """
    from peft import LoraConfig, get_peft_model

    if not isinstance(target_modules, str):
        target_modules = list(target_modules)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules, lora_dropout=0.0,
                        init_lora_weights=False, **lora_kwargs)
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    _random_lora_weights(peft_model, seed, scale)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def save_prompt_adapter(base_model, path, num_virtual_tokens: int = 4, seed: int = 0, scale: float = 1.0):
    """Write a PEFT prompt-tuning adapter with random soft-prompt embeddings; returns the PeftModel."""
    from peft import PromptTuningConfig, TaskType, get_peft_model

    config = PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=num_virtual_tokens)
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = peft_model.prompt_encoder["default"].embedding.weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * scale)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def model_spec(hf_model):
    """The adapters.ModelSpec of a transformers model."""
    from adapters import ModelSpec

    from lora_runner.model.lora_linear import decoder_lora_modules

    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
                 num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                 head_dim=head_dim, intermediate_size=cfg.intermediate_size)
    modules = decoder_lora_modules(types.SimpleNamespace(**sizes, fused_projections=False))
    return ModelSpec(**sizes, model_name=getattr(cfg, "_name_or_path", None) or None, modules=modules)


def write_hub_cache(cache_dir, repo_id: str, files_dir, commit: str, refs=("main",)) -> Path:
    """Lay `files_dir`'s files out as huggingface_hub's cache for `repo_id` at `commit` (offline tests).

    Layout: models--org--name/{refs/<ref>, snapshots/<commit>/<files>}; no trees/.
    """
    import shutil

    repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for f in Path(files_dir).iterdir():
        if f.is_file():
            shutil.copy(f, snap / f.name)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    for ref in refs:
        (repo_dir / "refs" / ref).write_text(commit)
    return snap


def edit_adapter_config(path, **changes) -> dict:
    """Rewrite fields of a saved adapter's adapter_config.json (a value of None deletes nothing; it sets null)."""
    import json

    config_path = Path(path) / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config, indent=2))
    return config


def edit_adapter_tensors(path, edit) -> None:
    """Replace a saved adapter's adapter_model.safetensors by ``edit(dict of tensors) -> dict of tensors``."""
    from safetensors.torch import load_file, save_file

    weights_path = Path(path) / "adapter_model.safetensors"
    tensors = edit(dict(load_file(str(weights_path))))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(weights_path), metadata={"format": "pt"})


class _RunsCodeWhenUnpickled:
    """Unpickling this calls pathlib.Path(marker).touch(): proof that a loader executed pickle code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def write_malicious_pickle(path, marker) -> Path:
    """Write ``path``/adapter_model.bin: a torch pickle that touches ``marker`` if it is ever unpickled unsafely."""
    target = Path(path) / "adapter_model.bin"
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(1),
                "payload": _RunsCodeWhenUnpickled(marker)}, str(target))
    return target


# ---------------------------------------------------------------- hostile: finite but huge LoRA weights
def save_huge_lora(base_model, path, magnitude: float = 1e18, seed: int = 0, r: int = 4, **lora_kwargs):
    """A PEFT LoRA whose weights are all finite (they pass the loader's NaN/inf check) but about
    ``magnitude`` in size, so its delta overflows float32 activations: its tenant's logits turn
    NaN/inf. Returns the PeftModel."""
    return save_lora(base_model, path, seed=seed, r=r, scale=magnitude, **lora_kwargs)


# ---- hostile adapters: backtracking regexes, files rewritten during a load, huge configs ----

# Catastrophic backtracking for Python's re on any module key; RE2 answers "no match" in linear time.
HOSTILE_PATTERNS = ("(.|.)*Z", ".{6}(.|.)*Z")
PATTERN_FIELDS = ("target_modules", "exclude_modules", "layers_pattern", "rank_pattern", "alpha_pattern")


def hostile_pattern_fields(field: str, pattern: str) -> dict:
    """adapter_config.json changes putting ``pattern`` where PEFT reads ``field`` as a regex."""
    if field in ("target_modules", "exclude_modules"):
        return {field: pattern}
    if field == "layers_pattern":
        return {"layers_pattern": pattern, "layers_to_transform": [0]}
    return {field: {pattern: 4}}  # rank_pattern / alpha_pattern: the key is the regex


def save_hostile_pattern_lora(base_model, path, field: str, pattern: str, **lora_kwargs) -> dict:
    """A valid PEFT LoRA whose config then gets ``pattern`` in ``field``; returns the config."""
    save_lora(base_model, path, **lora_kwargs)
    return edit_adapter_config(path, **hostile_pattern_fields(field, pattern))


def pad_adapter_config(path, nbytes: int) -> int:
    """Grow a saved adapter's adapter_config.json to ``nbytes`` with a junk field; returns its size."""
    import json

    config_path = Path(path) / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["padding"] = ""
    config["padding"] = "x" * max(0, nbytes - len(json.dumps(config)))
    config_path.write_text(json.dumps(config))
    return config_path.stat().st_size


def write_nested_config(path, depth: int) -> None:
    """adapter_config.json holding a list nested ``depth`` deep (small file, deep parser recursion)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "adapter_config.json").write_text('{"peft_type": "LORA", "x": ' + "[" * depth + "]" * depth + "}")


def save_lora_versions(base_model, root, **lora_kwargs) -> dict[str, Path]:
    """Two versions of one adapter with the same config and different weights and file sizes
    ("a": float32, seed 1; "b": float16, seed 2), so a mixed read of the two shows in its length."""
    dirs = {"a": Path(root) / "version-a", "b": Path(root) / "version-b"}
    save_lora(base_model, dirs["a"], seed=1, **lora_kwargs)
    save_lora(base_model, dirs["b"], seed=2, **lora_kwargs)
    edit_adapter_tensors(dirs["b"], lambda tensors: {k: v.half() for k, v in tensors.items()})
    return dirs


# ---------------------------------------------------------------- hostile adapters: adapter state
def save_nan_copy(source_dir, path) -> Path:
    """Copy a saved adapter (LoRA or prompt adapter) to ``path`` with every tensor NaN: it passes
    every check but the finiteness one, so its load fails with InvalidAdapterError."""
    import shutil

    shutil.copytree(source_dir, path)
    edit_adapter_tensors(path, lambda tensors: {k: v * float("nan") for k, v in tensors.items()})
    return Path(path)


def save_adapter_copy(source_dir, path) -> Path:
    """A byte-identical copy of a saved adapter under another path (another source for the same weights)."""
    import shutil

    shutil.copytree(source_dir, path)
    return Path(path)


# --- a byte-level BPE tokenizer whose tokens split UTF-8 sequences (incremental detokenization tests)
MULTIBYTE_CORPUS = ["café au lait, crème brûlée et déjà vu", "中文字符和汉字的句子",
                    "emoji 🙂🚀👍🏽 mixed with text", "naïve façade über straße",
                    "日本語のテキスト and ascii words", "the cat sat on the mat"]


def make_byte_level_tokenizer(vocab_size: int = 300):
    """A GPT-2 style byte-level BPE (transformers PreTrainedTokenizerFast) trained on
    MULTIBYTE_CORPUS: every byte is a token and few merges exist, so é, 中 and emoji are spread over
    several tokens, and a token may end inside a character. Specials: <s>, </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(MULTIBYTE_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
