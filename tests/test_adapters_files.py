"""Adapter files changing under a load, leaks, huge configs.

Safetensors weights are read into memory the process owns and parsed from there, so a file that is
truncated or rewritten at any stage of a load gives InvalidAdapterError or one version's exact
weights, never a SIGBUS; the race with a second process copying over the served file runs in a
subprocess, so a regression is a failed test rather than a dead pytest worker. 5,000 load/remove
cycles leave RSS where it was. ``adapter_config.json`` is capped at MAX_CONFIG_BYTES before reading.
"""

import gc
import json
import os
import shutil
import subprocess
import sys
import tracemalloc
from pathlib import Path

import psutil
import pytest
import safetensors.torch
import torch

import adapters.weights as adapter_files
from adapters import AdapterManager, AdapterTooLargeError, InvalidAdapterError, LoRARequest
from adapters.lora import load_lora
from adapters.prompt import load_prompt_adapter
from adapters.weights import MAX_CONFIG_BYTES, read_adapter_config, read_adapter_tensors
from tests import factories

REPO = Path(__file__).resolve().parents[1]
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def base():
    return factories.build_tiny_model("llama", seed=0, **factories.MICRO_LLAMA)


@pytest.fixture(scope="module")
def versions(base, tmp_path_factory):
    """{"a": dir, "b": dir} and each version's exact tensors as saved."""
    dirs = factories.save_lora_versions(base, tmp_path_factory.mktemp("versions"), r=2)
    return dirs, {k: safetensors.torch.load((d / WEIGHTS).read_bytes()) for k, d in dirs.items()}


@pytest.fixture
def served(versions, tmp_path):
    dirs, _ = versions
    shutil.copytree(dirs["a"], tmp_path / "served")
    return tmp_path / "served"


def same_tensors(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
                                             for k in want)


def mutate(path: Path, how: str, version_b: Path) -> None:
    """Change the served weights file the way a careless (or hostile) deployment would."""
    if how == "truncate":
        os.truncate(path, path.stat().st_size // 2)
    elif how == "rewrite-in-place":  # what cp does: same inode, O_TRUNC, then write
        shutil.copyfile(version_b / WEIGHTS, path)
    elif how == "grow":
        with open(path, "ab") as f:
            f.write(b"\0" * 64)
    elif how == "atomic-replace":  # write a temporary file, rename it over: readers keep the old inode
        shutil.copyfile(version_b / WEIGHTS, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
    elif how == "delete":
        path.unlink()


@pytest.mark.parametrize("how, outcome", [("truncate", "invalid"), ("rewrite-in-place", "invalid"),
                                          ("grow", "invalid"), ("atomic-replace", "a"), ("delete", "a")])
def test_file_changed_between_stat_and_read(served, versions, monkeypatch, how, outcome):
    dirs, tensors = versions
    real_check, fired = adapter_files._check_size, []

    def check_then_mutate(name, path, *args, **kwargs):  # runs after fstat, before the read
        real_check(name, path, *args, **kwargs)
        if path.endswith(WEIGHTS) and not fired:
            fired.append(path)
            mutate(Path(path), how, dirs["b"])

    monkeypatch.setattr(adapter_files, "_check_size", check_then_mutate)
    if outcome == "invalid":
        with pytest.raises(InvalidAdapterError, match="changed while it was read"):
            read_adapter_tensors("served", str(served))
    else:
        assert same_tensors(read_adapter_tensors("served", str(served)), tensors[outcome])
    assert fired


@pytest.mark.parametrize("how", ["truncate", "rewrite-in-place", "grow", "atomic-replace", "delete"])
def test_file_changed_between_read_and_parse_gives_the_version_read(served, versions, monkeypatch, how):
    dirs, tensors = versions
    real_load = safetensors.torch.load

    def mutate_then_parse(data):
        mutate(served / WEIGHTS, how, dirs["b"])
        return real_load(data)

    monkeypatch.setattr(safetensors.torch, "load", mutate_then_parse)
    assert same_tensors(read_adapter_tensors("served", str(served)), tensors["a"])


@pytest.mark.parametrize("keep", [0, 4, 8, 9, 200, -1])
def test_truncated_weights_are_invalid(served, keep):
    data = (served / WEIGHTS).read_bytes()
    (served / WEIGHTS).write_bytes(data[:keep] if keep >= 0 else data[:-1])
    with pytest.raises(InvalidAdapterError, match="corrupt safetensors"):
        read_adapter_tensors("served", str(served))


def test_loaded_weights_map_no_file_and_own_their_memory(served):
    tensors = read_adapter_tensors("served", str(served))
    with open("/proc/self/maps") as f:
        assert str(served) not in f.read()  # nothing of the adapter is memory-mapped
    for tensor in tensors.values():
        tensor.add_(0)  # a read-only buffer (a view of the parsed bytes) would refuse this
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == len(tensors)


_RACE_SCRIPT = r"""
import json, shutil, subprocess, sys, time
import safetensors.torch, torch
import adapters.lora as lora_module
from adapters import InvalidAdapterError, LoRARequest
from lora_runner import LLMEngine

model_dir, served, file_a, file_b, seconds, max_loads = sys.argv[1:7]
expected = {k: safetensors.torch.load(open(f, "rb").read()) for k, f in (("a", file_a), ("b", file_b))}
reads, real_read = [], lora_module.read_adapter_tensors
def recording_read(*args, **kwargs):
    reads.append(real_read(*args, **kwargs))
    return reads[-1]
lora_module.read_adapter_tensors = recording_read
engine = LLMEngine(model_dir, device="cpu", max_loras=1, max_lora_rank=8, max_cpu_loras=1, max_num_seqs=2,
                   max_model_len=32, block_size=4)
writer = subprocess.Popen([sys.executable, "-c", '''
import shutil, sys, time
end, sources = time.monotonic() + float(sys.argv[3]), sys.argv[1:3]
for i in range(200000):
    if time.monotonic() > end:
        break
    shutil.copyfile(sources[i % 2], sys.argv[4])  # cp over the served file: same inode, truncated, rewritten
''', file_a, file_b, seconds, served + "/adapter_model.safetensors"])
counts = {"a": 0, "b": 0, "invalid": 0}
for _ in range(int(max_loads)):
    if writer.poll() is not None:
        break
    reads.clear()
    try:
        engine.add_lora(LoRARequest("served", served))
    except InvalidAdapterError:
        counts["invalid"] += 1
        continue
    engine.remove_lora("served")
    got = reads[-1]
    match = [k for k, want in expected.items() if got.keys() == want.keys()
             and all(got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want)]
    assert match, "a load returned weights of neither version"
    counts[match[0]] += 1
writer.kill()
writer.wait()
print(json.dumps(counts))
"""


def test_cp_over_a_served_adapter_during_loads_never_kills_the_process(base, versions, tmp_path):
    dirs, _ = versions
    model_dir = tmp_path / "model"
    model = factories.save_tiny_model(model_dir, "llama", seed=0, tokenizer=False, **factories.MICRO_LLAMA)
    factories.save_tiny_tokenizer(model_dir, model.config.vocab_size)
    shutil.copytree(dirs["a"], tmp_path / "served")
    args = [str(model_dir), str(tmp_path / "served"), str(dirs["a"] / WEIGHTS), str(dirs["b"] / WEIGHTS), "3", "3000"]
    done = subprocess.run([sys.executable, "-c", _RACE_SCRIPT, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"exit {done.returncode} (SIGBUS is -7): {done.stderr[-2000:]}"
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\nloads while another process copied over the file: {counts}")
    assert sum(counts.values()) >= 10 and counts["a"] + counts["b"] >= 1


RSS_CYCLES, RSS_WARMUP, RSS_BOUND = 5000, 200, 3 << 20


@pytest.mark.slow
def test_load_remove_cycles_leave_rss_where_it_was(versions):
    dirs, _ = versions
    manager = AdapterManager(factories.model_spec(factories.build_tiny_model("llama", **factories.MICRO_LLAMA)),
                             max_loras=1, max_lora_rank=8, max_cpu_loras=1, device="cpu")
    process = psutil.Process()

    def cycles(count):
        for _ in range(count):
            manager.loras.add(LoRARequest("soak", str(dirs["a"])))
            manager.loras.remove("soak")
        gc.collect()
        return process.memory_info().rss

    before = cycles(RSS_WARMUP)
    after = cycles(RSS_CYCLES)
    print(f"\nRSS after {RSS_WARMUP} warm-up cycles {before / 2**20:.1f} MiB, after {RSS_CYCLES} more "
          f"{after / 2**20:.1f} MiB ({(after - before) / 2**10:+.0f} KiB)")
    assert after - before < RSS_BOUND


# ---- adapter_config.json size and shape --------------------------------------------------------------

def test_oversized_config_is_refused_before_reading(base, tmp_path):
    factories.save_lora(base, tmp_path, r=2)
    size = factories.pad_adapter_config(tmp_path, MAX_CONFIG_BYTES + 1)
    with pytest.raises(AdapterTooLargeError, match=f"{size} bytes, over the limit MAX_CONFIG_BYTES"):
        read_adapter_config("huge", str(tmp_path))
    os.truncate(tmp_path / "adapter_config.json", 200 << 20)  # the 200 MB config (sparse: free to make)
    tracemalloc.start()
    try:
        with pytest.raises(AdapterTooLargeError, match="MAX_CONFIG_BYTES"):
            read_adapter_config("huge", str(tmp_path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_CONFIG_BYTES  # refused from its size; nothing of it was read


def test_config_under_the_cap_loads_and_max_adapter_bytes_caps_it_lower(base, tmp_path):
    factories.save_lora(base, tmp_path, r=2)
    size = factories.pad_adapter_config(tmp_path, MAX_CONFIG_BYTES - 1024)
    spec = factories.model_spec(base)
    assert load_lora("big", str(tmp_path), spec, max_lora_rank=8).rank == 2
    with pytest.raises(AdapterTooLargeError, match="max_adapter_bytes"):
        read_adapter_config("big", str(tmp_path), max_bytes=size - 1)


def test_prompt_adapter_configs_are_capped_too(base, tmp_path):
    factories.save_prompt_adapter(base, tmp_path)
    factories.pad_adapter_config(tmp_path, MAX_CONFIG_BYTES + 1)
    with pytest.raises(AdapterTooLargeError, match="MAX_CONFIG_BYTES"):
        load_prompt_adapter("huge", str(tmp_path), factories.model_spec(base), max_prompt_adapter_tokens=8)


def test_deeply_nested_config_is_invalid(tmp_path):
    factories.write_nested_config(tmp_path, 100_000)  # 200 KB, under the size cap
    with pytest.raises(InvalidAdapterError, match="cannot parse"):
        read_adapter_config("nested", str(tmp_path))
