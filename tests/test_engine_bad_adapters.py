"""A catalogue of bad input. Each kind gets a documented exception whose message names what is
wrong (an adapters.AdapterError subclass for adapters, ValueError for arguments), while the engine
keeps serving every other request, whose output stays exactly what transformers/PEFT produce.
Adapter problems in LLMEngine fail only their own request (finish_reason "error", the exception in
``output.error``); ``add_lora`` raises the same exception synchronously. README "Failure behaviour".

Catalogue (kind -> exception: where; bare names are ADAPTER_CASES keys)
  missing dir / Hub repo / revision -> AdapterNotFoundError: missing-dir, missing-repo, missing-revision
  missing adapter_config.json, or a FIFO there -> AdapterNotFoundError: missing-config, config-is-a-fifo
  malformed adapter_config.json -> InvalidAdapterError: malformed-config, config-not-an-object,
      bad-config-value
  missing weights file -> AdapterNotFoundError: missing-weights
  truncated / corrupt safetensors, a header declaring 4 TB -> InvalidAdapterError: truncated-safetensors,
      corrupt-safetensors, crafted-4TB-header
  pickle .bin without allow_pickle -> UnsafeAdapterError: pickle-without-opt-in
  .bin that runs code, or whose size does not bound its memory, with opt-in -> UnsafeAdapterError:
      test_adapters_pickles.py
  NaN / inf weights -> InvalidAdapterError: nan-weights, inf-weights (fp16 overflow, integer weights:
      test_adapters_lora.py::test_broken_weights_are_invalid)
  wrong shapes, missing tensor -> InvalidAdapterError: wrong-shapes, missing-tensor
  rank above max_lora_rank -> AdapterTooLargeError: rank-over-max, huge-rank-in-config
  files over max_adapter_bytes -> AdapterTooLargeError: over-byte-limit
  unsupported PEFT type or feature -> UnsupportedAdapterError: unsupported-peft-type,
      unsupported-feature-modules-to-save, prompt-adapter-as-lora (each feature:
      test_adapters_lora.py::test_unsupported_features_are_refused_by_name)
  DoRA without its magnitude vectors, or with a NaN one -> InvalidAdapterError: dora-without-magnitudes,
      dora-nan-magnitude (other malformed DoRA: test_dora.py::test_malformed_dora_is_invalid)
  embed_tokens LoRA trained on a resized vocabulary -> InvalidAdapterError: embedding-lora-resized-vocab
      (other vocab LoRA refusals: test_vocab_lora.py::test_unservable_vocab_adapters_are_refused_clearly)
  prompt adapter with too many virtual tokens / another hidden size -> AdapterTooLargeError /
      InvalidAdapterError: test_bad_prompt_adapters_fail_only_their_own_request
  empty prompt, prompt over max_model_len, duplicate request id, ids outside the vocabulary, wrong
      argument types -> ValueError: test_engine_arguments.py
  invalid sampling parameters -> ValueError: test_engine_arguments.py (and test_sampling_params.py)
  unknown adapter name in remove / pin / unpin -> UnknownAdapterError: test_engine_arguments.py
  a pin that would leave no device slot for unpinned adapters -> AdapterCapacityError from pin_lora /
      pin_prompt_adapter: test_engine_adapter_lifecycle.py::test_pins_leave_a_slot_for_unpinned_adapters
  any call that adds or manages adapters after close() -> EngineClosedError:
      test_engine_adapter_lifecycle.py::test_close_returns_at_once_with_a_stalled_download_and_fails_its_requests
  a bad adapter in LLM.generate -> raised before any work:
      test_llm_generate.py::test_bad_adapter_raises_before_any_work
"""

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import huggingface_hub.constants
import pytest

from adapters import (
    AdapterError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    InvalidAdapterError,
    LoRARequest,
    PromptAdapterRequest,
    UnsafeAdapterError,
    UnsupportedAdapterError,
)
from lora_runner import SamplingParams
from tests import factories

from engine_support import assert_exact, assert_idle, make_engine, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)
HUB_COMMIT = "c0" * 20


@dataclass(frozen=True)
class Case:
    """One kind of bad adapter: how to build it, the exception it gets, a fragment of the message."""

    build: Callable  # (ctx, case name) -> LoRARequest
    error: type
    fragment: str


def _saved(ctx, name, **kwargs) -> Path:
    """A fresh, valid PEFT LoRA of the engine's base model (rank 4 unless told), to be broken."""
    path = ctx["root"] / name
    factories.save_lora(ctx["hf"], path, **{"r": 4, "seed": 7, "scale": 0.15, **kwargs})
    return path


def _edit_file(name, filename, edit, **save_kwargs):
    def build(ctx, case):
        path = _saved(ctx, name, **save_kwargs)
        edit(path / filename)
        return LoRARequest(case, str(path))
    return build


def _edit_config(name, **changes):
    def build(ctx, case):
        path = _saved(ctx, name)
        factories.edit_adapter_config(path, **changes)
        return LoRARequest(case, str(path))
    return build


def _dora_without_magnitudes(ctx, case):
    path = _saved(ctx, case, use_dora=True)
    factories.edit_adapter_tensors(path, lambda tensors: {k: v for k, v in tensors.items() if "magnitude" not in k})
    return LoRARequest(case, str(path))


def _nan_magnitude(tensors):
    key = next(k for k in sorted(tensors) if "lora_magnitude_vector" in k)
    tensors[key] = tensors[key].clone()
    tensors[key][0] = float("nan")
    return tensors


def _fewer_embedding_columns(tensors):
    key = next(k for k in tensors if k.endswith("lora_embedding_A"))  # [r, vocab]
    tensors[key] = tensors[key][:, :-3].contiguous()
    return tensors


def _edit_tensors(name, edit, **save_kwargs):
    def build(ctx, case):
        path = _saved(ctx, name, **save_kwargs)
        factories.edit_adapter_tensors(path, edit)
        return LoRARequest(case, str(path))
    return build


def _poison(value):
    def edit(tensors):
        key = sorted(tensors)[-1]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[3] = value
        return tensors
    return edit


def _crafted_header(path: Path) -> None:
    """A safetensors header declaring a 4 TB tensor in a tiny file: must fail without allocating."""
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [10**6, 10**6], "data_offsets": [0, 4 * 10**12]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 64)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _fifo(path: Path) -> None:
    """A named pipe instead of a file: reading it would block forever."""
    path.unlink()
    os.mkfifo(path)


def _pickle_only(ctx, case):
    path = ctx["root"] / case
    factories.save_lora(ctx["hf"], path, r=4, seed=7).save_pretrained(str(path), safe_serialization=False)
    (path / "adapter_model.safetensors").unlink(missing_ok=True)
    return LoRARequest(case, str(path))


def _other_model(ctx, case):
    other = factories.build_tiny_model("llama", seed=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    factories.save_lora(other, ctx["root"] / case, r=4)
    return LoRARequest(case, str(ctx["root"] / case))


def _prompt_tuning_dir(ctx, case):
    factories.save_prompt_adapter(ctx["hf"], ctx["root"] / case, num_virtual_tokens=4)
    return LoRARequest(case, str(ctx["root"] / case))


ADAPTER_CASES = {
    "missing-dir": Case(lambda ctx, case: LoRARequest(case, str(ctx["root"] / "no-such-dir")), AdapterNotFoundError,
                        "does not exist"),
    "missing-repo": Case(lambda ctx, case: LoRARequest(case, "org/no-such-repo"), AdapterNotFoundError,
                         "'org/no-such-repo'"),
    "missing-revision": Case(lambda ctx, case: LoRARequest(case, "org/tenant", "no-such-branch"),
                             AdapterNotFoundError, "'no-such-branch'"),
    "missing-config": Case(_edit_file("missing-config", "adapter_config.json", Path.unlink), AdapterNotFoundError,
                           "adapter_config.json not found"),
    "malformed-config": Case(_edit_file("malformed-config", "adapter_config.json",
                                        lambda p: p.write_text('{"peft_type": "LORA", "r": ')),
                             InvalidAdapterError, "cannot parse"),
    "config-not-an-object": Case(_edit_file("config-list", "adapter_config.json", lambda p: p.write_text("[4, 8]")),
                                 InvalidAdapterError, "must hold a JSON object"),
    "bad-config-value": Case(_edit_config("bad-config-value", r=-4), InvalidAdapterError,
                             "r must be a positive number"),
    "config-is-a-fifo": Case(_edit_file("fifo", "adapter_config.json", _fifo), AdapterNotFoundError,
                             "adapter_config.json not found"),
    "missing-weights": Case(_edit_file("missing-weights", "adapter_model.safetensors", Path.unlink),
                            AdapterNotFoundError, "no adapter_model.safetensors"),
    "truncated-safetensors": Case(_edit_file("truncated", "adapter_model.safetensors", _truncate),
                                  InvalidAdapterError, "corrupt safetensors"),
    "corrupt-safetensors": Case(_edit_file("corrupt", "adapter_model.safetensors",
                                           lambda p: p.write_bytes(os.urandom(p.stat().st_size))),
                                InvalidAdapterError, "corrupt safetensors"),
    "crafted-4TB-header": Case(_edit_file("crafted", "adapter_model.safetensors", _crafted_header),
                               InvalidAdapterError, "corrupt safetensors"),
    "pickle-without-opt-in": Case(_pickle_only, UnsafeAdapterError, "allow_pickle=True"),
    "nan-weights": Case(_edit_tensors("nan", _poison(float("nan"))), InvalidAdapterError, "contains NaN or inf"),
    "inf-weights": Case(_edit_tensors("inf", _poison(float("-inf"))), InvalidAdapterError, "contains NaN or inf"),
    "missing-tensor": Case(_edit_tensors("missing-tensor", lambda t: dict(sorted(t.items())[1:])),
                           InvalidAdapterError, "missing key"),
    "wrong-shapes": Case(_other_model, InvalidAdapterError, "expected"),
    "rank-over-max": Case(lambda ctx, case: LoRARequest(case, str(_saved(ctx, case, r=32))), AdapterTooLargeError,
                          "rank 32, over max_lora_rank=16"),
    "huge-rank-in-config": Case(_edit_config("huge-rank", r=10**9), AdapterTooLargeError,
                                "rank 1000000000, over max_lora_rank=16"),
    "over-byte-limit": Case(lambda ctx, case: LoRARequest(case, str(_saved(ctx, case, r=16))), AdapterTooLargeError,
                            "max_adapter_bytes="),
    "unsupported-peft-type": Case(_edit_config("ia3", peft_type="IA3"), UnsupportedAdapterError, "peft_type='IA3'"),
    "unsupported-feature-modules-to-save": Case(
        lambda ctx, case: LoRARequest(case, str(_saved(ctx, case, modules_to_save=["lm_head"]))),
        UnsupportedAdapterError, "modules_to_save"),
    "dora-without-magnitudes": Case(_dora_without_magnitudes, InvalidAdapterError, "lora_magnitude_vector is missing"),
    "dora-nan-magnitude": Case(_edit_tensors("dora-nan", _nan_magnitude, use_dora=True), InvalidAdapterError,
                               "lora_magnitude_vector contains NaN or inf"),
    "embedding-lora-resized-vocab": Case(
        _edit_tensors("resized-vocab", _fewer_embedding_columns, target_modules=["embed_tokens", "q_proj"]),
        InvalidAdapterError, "trained on a resized vocabulary"),
    "prompt-adapter-as-lora": Case(_prompt_tuning_dir, UnsupportedAdapterError, "peft_type='PROMPT_TUNING'"),
}


@pytest.fixture
def hub_cache(engine_checkpoint, tmp_path, monkeypatch):
    """An offline Hub cache (org/tenant at main = the r8-qv adapter) that the default resolver reads."""
    _, _, adapters = engine_checkpoint
    factories.write_hub_cache(tmp_path / "hub", "org/tenant", adapters["r8-qv"][0], HUB_COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


OFFLINE = dict(local_files_only=True)  # engines here resolve Hub ids from hub_cache only


def good_requests(engine_checkpoint, prefix):
    """(id, prompt, lora request, oracle model): two local LoRAs, one from the Hub cache, the base model."""
    _, hf, adapters = engine_checkpoint
    return [(f"{prefix}-r4", [5, 6, 7, 8], LoRARequest("r4", adapters["r4"][0]), adapters["r4"][1]),
            (f"{prefix}-hub", [9, 10, 11], LoRARequest("hub-tenant", "org/tenant"), adapters["r8-qv"][1]),
            (f"{prefix}-base", [12, 13], None, hf),
            (f"{prefix}-r16", [14, 15, 16, 17, 18], LoRARequest("r16-patterns", adapters["r16-patterns"][0]),
             adapters["r16-patterns"][1])]


@pytest.mark.filterwarnings("ignore::UserWarning")  # PEFT's warnings while writing DoRA / odd checkpoints
def test_bad_adapters_fail_only_their_own_request(engine_checkpoint, greedy_oracle, hub_cache, tmp_path):
    path, hf, adapters = engine_checkpoint
    ctx = dict(root=tmp_path, hf=hf)
    bad = {case: spec.build(ctx, case) for case, spec in ADAPTER_CASES.items()}
    limit = max(os.path.getsize(Path(adapters[n][0]) / "adapter_model.safetensors") for n in ("r4", "r16-patterns"))
    assert os.path.getsize(Path(bad["over-byte-limit"].path) / "adapter_model.safetensors") > limit
    engine = make_engine(path, **OFFLINE, max_adapter_bytes=limit)
    good = good_requests(engine_checkpoint, "good")
    for request_id, prompt, lora, _ in good[:2]:  # two tenants already running when the bad ones arrive
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    done = {o.request_id: o for o in engine.step() if o.finished}
    for i, (case, request) in enumerate(bad.items()):
        engine.add_request(f"bad-{case}", [20 + i, 21], GREEDY, lora_request=request)
        if i % 6 == 0:
            done.update({o.request_id: o for o in engine.step() if o.finished})
    for request_id, prompt, lora, _ in good[2:]:
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    for case, request in list(bad.items())[:8]:  # the synchronous path, while requests are in flight
        with pytest.raises(ADAPTER_CASES[case].error):
            engine.add_lora(request)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    run_to_completion(engine, done=done)

    for case, spec in ADAPTER_CASES.items():
        output = done[f"bad-{case}"]
        error = output.error
        assert output.outputs[0].finish_reason == "error" and output.outputs[0].token_ids == [], case
        assert isinstance(error, spec.error) and isinstance(error, AdapterError), (case, error)
        assert repr(case) in str(error) and spec.fragment in str(error), (case, str(error))
    for request_id, prompt, _, model in good:
        assert_exact(done[request_id], model, prompt, greedy_oracle)
    assert_idle(engine)
    assert sorted(engine.list_loras()) == ["hub-tenant", "r16-patterns", "r4"]  # failures leave nothing behind
    assert engine.adapters.manager.loras.memory_stats()["num_cpu"] == 3
    for case, request in bad.items():  # add_lora raises the same documented exception as the request got
        with pytest.raises(ADAPTER_CASES[case].error, match=re.escape(ADAPTER_CASES[case].fragment)):
            engine.add_lora(request)


def test_bad_prompt_adapters_fail_only_their_own_request(engine_checkpoint, greedy_oracle, tmp_path):
    path, hf, adapters = engine_checkpoint
    factories.save_prompt_adapter(hf, tmp_path / "too-long", num_virtual_tokens=9)
    other = factories.build_tiny_model("llama", seed=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    factories.save_prompt_adapter(other, tmp_path / "other-hidden", num_virtual_tokens=4)
    cases = {"too-long": (AdapterTooLargeError, "num_virtual_tokens=9 is over max_prompt_adapter_tokens=8"),
             "other-hidden": (InvalidAdapterError, "does not match the base model's hidden size 64")}
    engine = make_engine(path, **OFFLINE, max_prompt_adapters=1, max_prompt_adapter_tokens=8)
    engine.add_request("base", [5, 6, 7], GREEDY)
    engine.add_request("lora", [5, 6, 7, 8], GREEDY, lora_request=LoRARequest("r4", adapters["r4"][0]))
    for case in cases:
        engine.add_request(case, [8, 9], GREEDY,
                           prompt_adapter_request=PromptAdapterRequest(case, str(tmp_path / case)))
    done = run_to_completion(engine)
    for case, (error, fragment) in cases.items():
        assert done[case].outputs[0].finish_reason == "error" and isinstance(done[case].error, error)
        assert fragment in str(done[case].error) and repr(case) in str(done[case].error)
    assert_exact(done["base"], hf, [5, 6, 7], greedy_oracle)
    assert_exact(done["lora"], adapters["r4"][1], [5, 6, 7, 8], greedy_oracle)
    for case, (error, fragment) in cases.items():  # the synchronous path raises the same
        with pytest.raises(error, match=re.escape(fragment)):
            engine.add_prompt_adapter(PromptAdapterRequest(case, str(tmp_path / case)))
    assert_idle(engine)
