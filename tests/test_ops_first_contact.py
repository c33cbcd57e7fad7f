"""First contact with `lora-runner serve`: a wrong model, an offline Hub id or a taken port is one
line and exit status 2, and the port is bound before the model loads; a local adapter dir's
@REVISION is refused (it would be ignored)."""

from __future__ import annotations

import argparse
import socket

import pytest

from lora_runner.entrypoints import cli
from lora_runner.entrypoints.listen_socket import bind_listen_socket


def _serve(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", *argv, "--device", "cpu", "--port", "0"])
    return exited.value.code, capsys.readouterr().err


def test_a_missing_model_dir_is_one_line_and_exit_2(tmp_path, capsys):
    code, err = _serve([str(tmp_path / "no-such-model")], capsys)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("lora-runner: error: ") and "no-such-model" in err
    assert "Traceback" not in err


def test_an_offline_hub_id_not_in_the_cache_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    code, err = _serve(["no-such-org/no-such-model"], capsys)
    assert code == 2 and err.count("\n") == 1 and "offline" in err and "no-such-org/no-such-model" in err


def test_a_taken_port_is_said_before_the_model_loads(monkeypatch, engine_checkpoint, capsys):
    model_dir = engine_checkpoint[0]
    loaded = []
    monkeypatch.setattr(cli, "build_state", lambda *a: loaded.append(a))  # the model load starts here
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as exited:
            cli.main(["serve", model_dir, "--device", "cpu", "--port", str(port)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and f"127.0.0.1:{port}" in err and err.count("\n") == 1
    assert loaded == []


def test_the_socket_is_bound_while_the_model_loads(monkeypatch, engine_checkpoint):
    """Another process cannot take the port during the load: serve holds it from before build_state."""
    model_dir = engine_checkpoint[0]
    seen = {}

    def build_state(*configs):
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", seen["port"]))
            seen["bindable"] = True
        except OSError:
            seen["bindable"] = False
        finally:
            probe.close()
        raise ValueError("stop here")

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        seen["port"] = free.getsockname()[1]
    monkeypatch.setattr(cli, "build_state", build_state)
    with pytest.raises(SystemExit):
        cli.main(["serve", model_dir, "--device", "cpu", "--port", str(seen["port"])])
    assert seen["bindable"] is False
    bind_listen_socket("127.0.0.1", seen["port"]).close()  # released after the failed start


def test_bind_listen_socket_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match=rf"127\.0\.0\.1:{taken.getsockname()[1]}"):
            bind_listen_socket("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize("spec", ["a={dir}@v2", '{{"name": "a", "path": "{dir}", "revision": "v2"}}'])
def test_a_revision_on_a_local_adapter_dir_is_refused(tmp_path, spec):
    with pytest.raises(argparse.ArgumentTypeError, match="local directory has no revisions"):
        cli.adapter_spec(spec.format(dir=tmp_path))


def test_hub_ids_keep_their_revision_and_a_local_dir_may_hold_an_at(tmp_path):
    assert cli.adapter_spec("a=org/repo@v2") == ("a", "org/repo", "v2")
    odd = tmp_path / "tenant@2"
    odd.mkdir()
    assert cli.adapter_spec(f"a={odd}") == ("a", str(odd), None)
