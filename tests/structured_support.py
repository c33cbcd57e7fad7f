"""Shared by tests/test_structured_outputs*.py: a tiny Llama whose tokenizer is byte-level BPE (every
byte is a token, so any JSON text can be written; the model's vocabulary is padded past the
tokenizer's), two PEFT LoRAs on it, and random JSON schemas that a random model completes quickly."""

from __future__ import annotations

import random
from pathlib import Path

MODEL_VOCAB = 320  # padded past the tokenizer's 300 ids: ids 300..319 must stay banned
BYTE_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")


def save_byte_checkpoint(root: Path) -> tuple[str, dict[str, str]]:
    """(model dir, {lora name: dir}) under `root`."""
    from factories import make_byte_level_tokenizer, save_lora, save_tiny_model

    model_dir = root / "model"
    hf = save_tiny_model(model_dir, "llama", seed=0, tokenizer=False, vocab_size=MODEL_VOCAB, bos_token_id=0,
                         eos_token_id=1, pad_token_id=0)
    tokenizer = make_byte_level_tokenizer(300)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    tokenizer.save_pretrained(str(model_dir))
    loras = {}
    for name, seed in (("a", 1), ("b", 2)):
        save_lora(hf, root / name, seed=seed, r=4, lora_alpha=8, scale=0.15)
        loras[name] = str(root / name)
    return str(model_dir), loras


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object schema: nested objects, enums, bounded integers, short strings, bounded arrays,
    booleans, some properties required."""
    kinds = ["integer", "enum", "string", "boolean", "array"] + (["object"] if depth < 2 else [])
    properties = {}
    for i in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        if kind == "integer":
            low = rng.randint(-50, 50)
            prop = {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
        elif kind == "enum":
            prop = {"enum": rng.sample(["red", "green", "blue", "x y", "q\"uote"], rng.randint(1, 3))}
        elif kind == "string":
            prop = {"type": "string", "minLength": 1, "maxLength": rng.randint(1, 4)}
        elif kind == "boolean":
            prop = {"type": "boolean"}
        elif kind == "array":
            low = rng.randint(0, 2)
            prop = {"type": "array", "items": rng.choice([{"type": "boolean"}, {"enum": [1, 2, 3]}]),
                    "minItems": low, "maxItems": low + rng.randint(0, 2)}
        else:
            prop = random_schema(rng, depth + 1)
        properties[f"p{depth}{i}"] = prop
    names = list(properties)
    return {"type": "object", "properties": properties, "required": rng.sample(names, rng.randint(1, len(names))),
            "additionalProperties": False}
