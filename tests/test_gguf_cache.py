"""The loader's GGUF path: a .gguf model is converted once per file content and then read from
the cache; a failed conversion leaves nothing behind. (The conversion itself, on the real
SmolLM2 file against transformers, is in test_real_model.py.)"""

import pytest

from lora_runner.model import gguf
from lora_runner.model.loader import resolve_model_dir


@pytest.fixture
def conversions(monkeypatch, tmp_path):
    """Stand-in for the dequantizing conversion: records its calls and writes a marker file."""
    calls = []

    def convert(path, out_dir):
        calls.append(path.read_bytes())
        if path.read_bytes() == b"broken":
            raise ValueError("unsupported architecture")
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(gguf, "convert_gguf", convert)
    monkeypatch.setenv("LORA_RUNNER_CACHE", str(tmp_path / "cache"))
    return calls


def test_gguf_converted_once_per_content(conversions, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights v1")
    first = resolve_model_dir(str(model))
    assert first.parent == tmp_path / "cache" / "gguf" and (first / "config.json").is_file()
    assert resolve_model_dir(str(model)) == first and conversions == [b"weights v1"]  # cached
    model.write_bytes(b"weights v2")  # same name, new content: converted again, elsewhere
    second = resolve_model_dir(str(model))
    assert second != first and conversions == [b"weights v1", b"weights v2"]


def test_failed_conversion_leaves_nothing(conversions, tmp_path):
    model = tmp_path / "bad.gguf"
    model.write_bytes(b"broken")
    with pytest.raises(ValueError, match="unsupported architecture"):
        resolve_model_dir(str(model))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gguf.gguf_model_dir(tmp_path / "missing.gguf")
