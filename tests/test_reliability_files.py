"""A tenant's files can neither freeze, escape nor exhaust the server (issue 23, items 1, 3, 4, 6).

Through the real server, with per-tenant keys: tenant A is an admin loading from its own folder
``root/a`` of --adapter-root (the default sub-root: its name), tenant B is a bystander whose
completions and model list must keep answering, with exact tokens, while A attacks: a FIFO for a
config, loads that hang, symlinked files and folders, a folder swapped for a symlink in a loop,
B's folder, and a 1.5 GiB sparse weights file.
"""

import json
import os
import shutil
import struct
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from serve_support import PROMPTS, offline_greedy, serve_args, start_server, token_ids

from adapters import InvalidAdapterError
from adapters.file_limits import default_max_adapter_bytes
from adapters.weights import read_adapter_tensors
from tests import factories

A, B = "key-tenant-a-0000", "key-tenant-b-0000"
KEYS = {A: {"name": "a", "adapters": ["a1", "a2", "a3", "a4", "a5", "a6"], "admin": True},
        B: {"name": "b", "adapters": ["r8-qv"], "base": True}}
BYSTANDER_BOUND_S = 5.0  # generous: each bystander call must answer within it while the attack runs
LOAD_TIMEOUT_S = 3
HUGE = 3 << 29  # 1.5 GiB
WEIGHTS = "adapter_model.safetensors"


def _huge_safetensors(path) -> None:
    """A valid header declaring one 1.5 GiB F32 tensor, then a hole: sparse, nothing on disk."""
    header = json.dumps({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": {
        "dtype": "F32", "shape": [HUGE // 4], "data_offsets": [0, HUGE]}}).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + HUGE)


@pytest.fixture(scope="module")
def served(engine_checkpoint, tmp_path_factory):
    """(server, state, model dir, work dir, {name: adapter path})."""
    import yaml

    model_dir, _, adapters = engine_checkpoint
    paths = {name: path for name, (path, _) in adapters.items()}
    work = tmp_path_factory.mktemp("reliability-files")
    root, outside = work / "root", work / "outside"
    for folder in (root / "a", root / "b", outside):
        folder.mkdir(parents=True)
    shutil.copytree(paths["r4"], root / "a" / "good")
    shutil.copytree(paths["r8-qv"], root / "b" / "secret")
    shutil.copytree(paths["r8-rslora"], outside / "secret")
    (root / "a" / "links").mkdir()
    for file in ("adapter_config.json", WEIGHTS):  # a real folder whose files point outside
        os.symlink(outside / "secret" / file, root / "a" / "links" / file)
    os.symlink(outside / "secret", root / "a" / "dir-link")
    shutil.copytree(paths["r4"], root / "a" / "fifo")
    (root / "a" / "fifo" / "adapter_config.json").unlink()
    os.mkfifo(root / "a" / "fifo" / "adapter_config.json")
    (root / "a" / "swap").mkdir()  # inside: invalid, so any load that succeeds read the outside one
    (root / "a" / "swap" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 0}')
    shutil.copytree(paths["r4"], root / "a" / "big")
    _huge_safetensors(root / "a" / "big" / WEIGHTS)
    keys_file = work / "keys.yaml"
    keys_file.write_text(yaml.safe_dump(KEYS))
    server, state = start_server(serve_args(model_dir, {"r8-qv": paths["r8-qv"]}, extra=[
        "--tenant-keys", str(keys_file), "--allow-runtime-lora-updating", "--adapter-root", str(root),
        "--adapter-load-timeout", str(LOAD_TIMEOUT_S)]))
    yield server, state, model_dir, work, paths
    _release_fifo_readers(root / "a" / "fifo" / "adapter_config.json")
    server.stop()


def _release_fifo_readers(fifo) -> None:
    """A reader blocked in open() of the FIFO (a regression) returns once a writer opens it."""
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    os.close(fd)


def _post(served, path, body, key, timeout=60.0):
    return httpx.post(served[0].base_url + path, json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=timeout)


def _load(served, name, path, key=A):
    return _post(served, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, key)


@pytest.fixture(scope="module")
def bystander(served):
    """check() -> None: B's model list and a greedy completion answer within the bound, tokens exact."""
    _, state, model_dir, _, paths = served
    [expected] = offline_greedy(model_dir, [(PROMPTS[1], "r8-qv", None)], 6, paths)

    def check() -> None:
        # a fresh client each time: a kept-alive connection the server closed meanwhile is no answer at all
        with openai.OpenAI(base_url=served[0].base_url + "/v1", api_key=B, max_retries=0,
                           timeout=BYSTANDER_BOUND_S) as client:
            assert {m.id for m in client.models.list().data} == {"base", "r8-qv"}
            answer = client.completions.create(model="r8-qv", prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                               logprobs=0)
        assert token_ids(state.tokenizer, answer.choices[0].logprobs.tokens) == expected

    return check


def _served_names(served) -> set[str]:
    return set(served[1].engine.list_loras()) | {a.name for a in served[1].adapters(
        served[1].keys.authenticate(f"Bearer {A}"))}


def _flood(served, bystander, name, path, count=48):
    """`count` concurrent loads by A while B checks three times; A's statuses."""
    with ThreadPoolExecutor(count) as pool:
        loads = [pool.submit(_load, served, name, path) for _ in range(count)]
        time.sleep(0.5)  # let the loads start (and, before the fix, take every shared thread)
        for _ in range(3):
            bystander()
        return [f.result() for f in loads]


def test_a_fifo_config_answers_at_once_and_never_freezes_anyone(served, bystander):
    responses = _flood(served, bystander, "a1", "fifo")
    statuses = Counter(r.status_code for r in responses)
    assert set(statuses) <= {422, 429} and statuses[422] >= 1, statuses  # never 504: nothing waited on the FIFO
    refused = next(r for r in responses if r.status_code == 422).json()["error"]["message"]
    assert "not a regular file" in refused and str(served[3]) not in refused
    assert "a1" not in _served_names(served)


def test_loads_that_hang_are_capped_per_tenant_timed_out_and_undone(served, bystander, monkeypatch):
    state = served[1]
    gate, real_serve = threading.Event(), state.engine.serve_adapter

    def hanging_serve(request, **kwargs):  # a load stuck on a slow disk, whatever the reason
        gate.wait(60)
        return real_serve(request, **kwargs)

    monkeypatch.setattr(state.engine, "serve_adapter", hanging_serve)
    try:
        responses = _flood(served, bystander, "a2", "good")
    finally:
        gate.set()
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {504: 1, 429: len(responses) - 1}, statuses  # one runs (per-tenant cap), to its deadline
    deadline = time.monotonic() + 30
    while state.loads.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.loads.running == 0
    assert "a2" not in _served_names(served)  # it finished after its 504: undone
    monkeypatch.undo()
    assert _load(served, "a2", "good").status_code == 200  # the tenant can load again
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "a2"}, A).status_code == 200


@pytest.mark.parametrize("path, status", [("links", 422), ("dir-link", 403), ("dir-link/", 403)])
def test_symlinked_files_and_folders_are_refused(served, bystander, path, status):
    response = _load(served, "a3", path)
    assert response.status_code == status, response.text
    assert "symbolic link" in response.json()["error"]["message"]
    assert str(served[3]) not in response.text
    assert "a3" not in _served_names(served)
    bystander()


def test_a_folder_swapped_for_a_symlink_in_a_loop_is_never_followed(served, bystander):
    swap = served[3] / "root" / "a" / "swap"
    parked, outside = swap.with_name("swap-parked"), served[3] / "outside" / "secret"
    stop = threading.Event()

    def swapper():
        while not stop.is_set():
            os.rename(swap, parked)
            os.symlink(outside, swap)
            os.unlink(swap)
            os.rename(parked, swap)

    thread = threading.Thread(target=swapper, daemon=True)
    thread.start()
    try:
        outcomes = Counter()
        for _ in range(60):
            response = _load(served, "a4", "swap")
            outcomes[response.status_code] += 1
            if response.status_code == 200:  # an escape: undo it so the next try can race again
                _post(served, "/v1/unload_lora_adapter", {"lora_name": "a4"}, A)
    finally:
        stop.set()
        thread.join()
    assert outcomes[200] == 0, outcomes
    assert outcomes[422] > 0 and set(outcomes) <= {403, 422}, outcomes
    bystander()


def test_a_tenant_cannot_load_another_tenants_folder_nor_learn_what_exists(served):
    root = served[3] / "root"

    def answer(path):
        response = _load(served, "a5", path)
        assert str(served[3]) not in response.text
        return response.status_code, response.text.replace(path, "PATH")

    # B's folder, by every name A could try: the shared root's layout, '..', B's folder name
    assert answer("b/secret") == answer("b/no-such-folder") == answer("no-such-folder")
    assert answer("b/secret")[0] == 422
    assert answer("secret") == answer("no-such-folder")
    assert answer("../b/secret") == answer("../b/no-such-folder") == answer("../../outside/secret")
    assert answer("../b/secret")[0] == 403
    assert (root / "b" / "secret").is_dir() and "a5" not in _served_names(served)
    assert _load(served, "a5", "good").status_code == 200  # its own folder loads
    assert _post(served, "/v1/unload_lora_adapter", {"lora_name": "a5"}, A).status_code == 200


class _PeakRSS:
    """The process's largest resident set while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self._process, self._stop = psutil.Process(), threading.Event()
        self.start = self.peak = self._process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.start


def test_a_huge_sparse_weights_file_is_refused_before_it_is_read(served, bystander):
    with _PeakRSS() as rss:
        responses = [_load(served, "a6", "big") for _ in range(2)]
    for response in responses:
        assert response.status_code == 422, response.text
        message = response.json()["error"]["message"]
        assert f"is {os.path.getsize(served[3] / 'root' / 'a' / 'big' / WEIGHTS)} bytes" in message
        assert "max_adapter_bytes=" in message
    assert rss.growth < 256 << 20, rss.growth  # generous: the file is 1.5 GiB, twice
    assert "a6" not in _served_names(served)
    bystander()


def test_a_huge_file_without_a_byte_limit_is_refused_by_its_header(served, tmp_path):
    """A library caller with no limit: a header that does not describe the file is refused having read
    a few bytes; the 1.5 GiB of zeros (a sparse file) or of claimed tensors never reach memory."""
    (tmp_path / "zeros").mkdir()
    with open(tmp_path / "zeros" / WEIGHTS, "wb") as f:
        f.truncate(HUGE)
    (tmp_path / "claims").mkdir()
    header = json.dumps({"x": {"dtype": "F32", "shape": [HUGE // 4], "data_offsets": [0, HUGE]}}).encode()
    (tmp_path / "claims" / WEIGHTS).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    for case in ("zeros", "claims"):
        with _PeakRSS() as rss, pytest.raises(InvalidAdapterError, match="corrupt safetensors"):
            read_adapter_tensors(case, str(tmp_path / case), max_bytes=None)
        assert rss.growth < 128 << 20, (case, rss.growth)


def test_the_default_byte_limit_fits_every_valid_adapter_of_the_model(engine_checkpoint, tmp_path):
    _, hf, _ = engine_checkpoint
    spec = factories.model_spec(hf)
    full = factories.save_lora(hf, tmp_path / "full", r=16, use_dora=True,
                               target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"])
    del full
    size = (tmp_path / "full" / WEIGHTS).stat().st_size
    limit = default_max_adapter_bytes(spec, max_lora_rank=16)
    assert size <= limit < HUGE
    assert default_max_adapter_bytes(spec, 16, max_prompt_adapter_tokens=10**6) > limit  # soft prompts count too
