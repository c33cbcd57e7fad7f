"""Ray mode's SIGTERM: an in-flight stream ends with a final event and ``data: [DONE]``, as in one
process (tests/test_serve_concurrency.py), instead of being cut when Serve shuts down. Slow: a real
`serve --num-replicas 2` process starts its own local Ray instance."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_until_serving(process: subprocess.Popen, base: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"serve exited with {process.returncode}"
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError("the Ray server did not come up")


def test_sigterm_ends_in_flight_streams_with_a_final_event_and_done(engine_checkpoint, tmp_path):
    model_dir, _, adapters = engine_checkpoint
    port = _free_port()
    command = [sys.executable, "-m", "lora_runner.serve", model_dir, "--device", "cpu", "--dtype", "float32",
               "--port", str(port), "--num-replicas", "2", "--replica-cpus", "0.5", "--max-model-len", "512",
               "--served-model-name", "base", "--shutdown-timeout", "0", "--lora-modules", f"r4={adapters['r4'][0]}"]
    env = {**os.environ, "RAY_SERVE_QUEUE_LENGTH_RESPONSE_DEADLINE_S": "2", "RAY_DEDUP_LOGS": "0"}
    log = (tmp_path / "serve.log").open("w")
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until_serving(process, base)
        body = {"model": "r4", "prompt": "hello world", "max_tokens": 500, "temperature": 0.0, "stream": True,
                "ignore_eos": True}
        events = []
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[len("data: "):])
                if len(events) == 1:
                    process.send_signal(signal.SIGTERM)
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort", last  # 500 tokens take longer than the drain
        assert process.wait(timeout=120) == 0
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        log.close()
