"""Many concurrent streams over more adapters than device slots; the real CLI process and SIGTERM."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_support import PROMPTS, offline_greedy, serve_args, start_server, token_ids

from lora_runner.entrypoints.cli import main

ADAPTERS = ("r4", "r8-rslora", "r16-patterns", "r8-qv", "r16-mlp")
EXTRA_ADAPTERS = {"x1": dict(seed=21, r=4), "x2": dict(seed=22, r=8), "x3": dict(seed=23, r=16)}  # 8 LoRAs in all
NUM_REQUESTS = 64
MAX_TOKENS = 8


@pytest.mark.slow
def test_concurrent_streams_over_more_adapters_than_slots_all_complete_exactly(engine_checkpoint, tmp_path):
    """64 concurrent streams over 8 LoRAs and the base model, 2 device slots: all complete, exact."""
    from factories import save_lora

    model_dir, hf, adapters = engine_checkpoint
    loras = {name: adapters[name][0] for name in ADAPTERS}
    for name, kwargs in EXTRA_ADAPTERS.items():
        save_lora(hf, tmp_path / name, scale=0.15, **kwargs)
        loras[name] = str(tmp_path / name)
    models = (None, *loras)
    jobs = [(PROMPTS[i % len(PROMPTS)], models[i % len(models)], None) for i in range(NUM_REQUESTS)]
    expected = offline_greedy(model_dir, jobs, MAX_TOKENS, loras)
    server, state = start_server(serve_args(model_dir, loras))  # max_loras=2: slots churn
    try:
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def one(prompt, lora):
            stream = await client.completions.create(model=lora or "base", prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, logprobs=0, stream=True)
            return [t async for chunk in stream for t in chunk.choices[0].logprobs.tokens]

        async def run_all():
            try:
                return await asyncio.gather(*(one(p, lora) for p, lora, _ in jobs))
            finally:
                await client.close()

        outputs = asyncio.run(run_all())
        assert [token_ids(state.tokenizer, o) for o in outputs] == expected
        stats = state.engine.engine.adapters.manager.stats
        assert stats.lora_evictions > 0  # eight adapters through two slots
        assert not state.engine.engine.has_unfinished_requests()
        assert state.engine.engine.block_manager.num_used_blocks == 0
    finally:
        server.stop()


def test_cli_help_and_a_bad_startup_adapter_exit_cleanly(engine_checkpoint, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0 and "--tenant-keys" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["serve", engine_checkpoint[0], "--device", "cpu", "--lora-modules", f"x={tmp_path / 'missing'}"])
    assert info.value.code == 2 and "missing" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_the_server_process_shuts_down_on_sigterm_with_a_stream_in_flight(engine_checkpoint):
    model_dir, _, adapters = engine_checkpoint
    port = _free_port()
    command = [sys.executable, "-m", "lora_runner.serve", model_dir, "--port", str(port), "--device", "cpu",
               "--dtype", "float32", "--max-model-len", "512", "--shutdown-timeout", "1", "--log-level", "warning",
               "--lora-modules", f"r4={adapters['r4'][0]}"]
    process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": "r4", "prompt": "hello", "max_tokens": 500, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as stream:
            lines = stream.iter_lines()
            next(lines)
            process.send_signal(signal.SIGTERM)
            began = time.monotonic()
            rest = [line for line in lines if line]  # aborted after the 1 s grace period: a clean end
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"abort"' in rest[-2], rest[-3:]
        # uvicorn re-raises the captured SIGTERM once it has shut down, so the exit is by that signal
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert b"Traceback" not in process.stdout.read()
        assert time.monotonic() - began < 60
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
