"""Ray mode (serve --num-replicas N) checks the model, the port and the startup adapters before Ray
starts: each problem is one line and exit status 2, as in one process (replicas would otherwise fail
one by one, or load a bad LoRA lazily and answer 422 much later)."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from lora_runner.entrypoints import cli

pytest.importorskip("ray.serve")


@pytest.fixture
def started(monkeypatch):
    """The configs serve_on_ray was called with (Ray itself is not started)."""
    from lora_runner.entrypoints.ray import app

    calls = []
    monkeypatch.setattr(app, "serve_on_ray", lambda *configs: calls.append(configs))
    return calls


def _serve(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *argv, "--device", "cpu", "--num-replicas", "2", "--port", "0"])
    return exited.value.code, capsys.readouterr().err


def _broken_lora(source: str, path: Path) -> str:
    path.mkdir()
    shutil.copy(Path(source) / "adapter_config.json", path / "adapter_config.json")
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    return str(path)


def test_a_bad_startup_lora_ends_the_command_before_ray_starts(engine_checkpoint, tmp_path, capsys, started):
    model_dir, _, adapters = engine_checkpoint
    broken = _broken_lora(adapters["r4"][0], tmp_path / "broken")
    code, err = _serve([model_dir, "--lora-modules", f"good={adapters['r4'][0]}", f"bad={broken}"], capsys)
    assert code == 2 and err.count("\n") == 1 and "'bad'" in err and started == []


def test_a_lora_too_large_for_max_lora_rank_is_refused_at_startup(engine_checkpoint, capsys, started):
    model_dir, _, adapters = engine_checkpoint
    code, err = _serve([model_dir, "--max-lora-rank", "8", "--lora-modules",
                        f"big={adapters['r16-patterns'][0]}"], capsys)
    assert code == 2 and "'big'" in err and started == []


def test_a_wrong_model_path_ends_the_command_before_ray_starts(tmp_path, capsys, started):
    code, err = _serve([str(tmp_path / "no-model")], capsys)
    assert code == 2 and "no-model" in err and started == []


def test_a_taken_port_ends_the_command_before_ray_starts(engine_checkpoint, capsys, started):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", engine_checkpoint[0], "--device", "cpu", "--num-replicas", "2",
                      "--port", str(taken.getsockname()[1])])
    assert exited.value.code == 2 and "cannot listen" in capsys.readouterr().err and started == []


def test_good_startup_adapters_reach_ray(engine_checkpoint, capsys, started):
    model_dir, _, adapters = engine_checkpoint
    assert cli.main(["serve", model_dir, "--device", "cpu", "--num-replicas", "2", "--port", "0", "--lora-modules",
                     *[f"{name}={path}" for name, (path, _) in adapters.items()]]) == 0
    assert len(started) == 1 and len(started[0][2].loras) == len(adapters)
