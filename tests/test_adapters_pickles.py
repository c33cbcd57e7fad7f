"""Pickle checkpoints (``adapter_model.bin``), even with ``allow_pickle=True``: a file that would run
code when unpickled never does, and a file whose memory use its size does not bound (legacy torch
format, compressed zip entries) is refused before anything is allocated. Each fails only its own
request with UnsafeAdapterError; a legitimate .bin still serves exactly what PEFT computes.
"""

import os
import pickle
import re
import shutil
import zipfile

import pytest
import torch

from adapters import LoRARequest, UnsafeAdapterError
from tests import factories
from engine_support import assert_exact, assert_idle, make_engine, run_to_completion
from test_engine_bad_adapters import GREEDY, OFFLINE, good_requests, hub_cache  # noqa: F401 - hub_cache is a fixture


class _RunsShell:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _bin_variant(kind):
    """A .bin next to a valid config: code that runs if unpickled unsafely (torch zip calling Path.touch
    or os.system, a raw pickle), or memory the file size does not bound (legacy format, zip bomb)."""
    def build(ctx, case):
        path, marker = ctx["root"] / case, ctx["root"] / f"{case}.pwned"
        shutil.copytree(ctx["legit_bin"], path)
        target = path / "adapter_model.bin"
        state = torch.load(str(target), weights_only=True)
        target.unlink()
        if kind == "touch":
            factories.write_malicious_pickle(path, marker)
        elif kind == "system":
            torch.save({**state, "payload": _RunsShell(marker)}, str(target))
        elif kind == "raw":
            target.write_bytes(pickle.dumps({"weights": _RunsShell(marker)}))
        elif kind == "legacy":
            torch.save(state, str(target), _use_new_zipfile_serialization=False)
        else:  # zip bomb: 8 MB of zeros deflated to a few KB, under a 1 MB limit
            torch.save({**state, "padding": torch.zeros(2 * 2**20)}, str(path / "plain.bin"))
            with zipfile.ZipFile(path / "plain.bin") as plain, \
                    zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED) as bomb:
                for entry in plain.infolist():
                    bomb.writestr(entry.filename, plain.read(entry.filename))
            (path / "plain.bin").unlink()
            assert target.stat().st_size < 2**20
        return LoRARequest(case, str(path)), marker
    return build


PICKLE_CASES = {  # case -> (.bin kind, message fragment)
    "malicious-touch": ("touch", "only tensors are allowed"),
    "malicious-system": ("system", "only tensors are allowed"),
    "malicious-raw-pickle": ("raw", "not a zip-format torch checkpoint"),
    "legacy-format": ("legacy", "not a zip-format torch checkpoint"),
    "zip-bomb": ("bomb", "compressed entries"),
}


def test_pickles_never_execute_nor_overallocate_even_with_opt_in(engine_checkpoint, greedy_oracle, hub_cache,
                                                                 tmp_path):
    path, hf, adapters = engine_checkpoint
    legit = tmp_path / "legit-bin"
    factories.save_lora(hf, tmp_path / "st", **{"seed": 1, "r": 4, "lora_alpha": 8, "scale": 0.15}).save_pretrained(
        str(legit), safe_serialization=False)
    ctx = dict(root=tmp_path, hf=hf, legit_bin=legit)
    bad = {case: _bin_variant(kind)(ctx, case) for case, (kind, _) in PICKLE_CASES.items()}
    engine = make_engine(path, **OFFLINE, allow_pickle=True, max_adapter_bytes=2**20)
    good = good_requests(engine_checkpoint, "good") + [("good-bin", [30, 31, 32], LoRARequest("bin", str(legit)),
                                                         adapters["r4"][1])]  # r4 is seed 1, r 4, alpha 8
    for request_id, prompt, lora, _ in good[:2]:
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    for case, (request, _) in bad.items():
        engine.add_request(case, [40, 41], GREEDY, lora_request=request)
    for request_id, prompt, lora, _ in good[2:]:
        engine.add_request(request_id, prompt, GREEDY, lora_request=lora)
    done = run_to_completion(engine)
    for case, (request, marker) in bad.items():
        fragment = PICKLE_CASES[case][1]
        with pytest.raises(UnsafeAdapterError, match=re.escape(fragment)):
            engine.add_lora(request)
        error = done[case].error
        assert isinstance(error, UnsafeAdapterError) and fragment in str(error) and repr(case) in str(error)
        assert not marker.exists(), f"{case}: unpickling ran code"
    for request_id, prompt, _, model in good:
        assert_exact(done[request_id], model, prompt, greedy_oracle)
    assert_idle(engine)
