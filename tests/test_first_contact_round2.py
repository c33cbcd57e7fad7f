"""First contact with `lora-runner serve`, round 2: a startup adapter whose local folder does not exist
is one line before the model loads, and the log says where the server listens once uvicorn is up."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import pytest

from lora_runner.entrypoints import cli


def test_a_missing_local_startup_adapter_is_one_line_before_the_model_loads(monkeypatch, tmp_path,
                                                                             engine_checkpoint, capsys):
    loaded = []
    monkeypatch.setattr(cli, "build_state", lambda *a: loaded.append(a))  # the model load starts here
    missing = tmp_path / "no-such-lora"
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", engine_checkpoint[0], "--device", "cpu", "--port", "0",
                  "--lora-modules", f"sql={missing}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert "'sql'" in err and str(missing) in err
    assert loaded == []


def test_a_bad_startup_adapter_is_one_line_before_the_model_loads(monkeypatch, tmp_path, engine_checkpoint,
                                                                  capsys, caplog):
    loaded = []
    monkeypatch.setattr(cli, "build_state", lambda *a: loaded.append(a))
    (tmp_path / "empty").mkdir()  # a folder, but no adapter in it
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", engine_checkpoint[0], "--device", "cpu", "--port", "0",
                  "--lora-modules", f"sql={tmp_path / 'empty'}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "adapter_config.json" in err, err
    assert loaded == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_hub_id_is_left_to_the_loader(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder of that name here: a Hub id, which only the loader can check
    adapters = cli.startup_adapters(SimpleNamespace(lora_modules=[("sql", "org/sql-lora", None)],
                                                    prompt_adapters=[]))
    cli.check_local_adapter_paths(adapters)


def _asgi_app():
    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
    return app


def test_the_log_says_once_where_the_server_listens(monkeypatch, engine_checkpoint, caplog):
    async def drained(timeout):
        return True

    state = SimpleNamespace(draining=False, config=SimpleNamespace(shutdown_timeout=1.0),
                            engine=SimpleNamespace(drain=drained))
    monkeypatch.setattr(cli, "build_state", lambda *a: state)
    monkeypatch.setattr(cli, "build_app", lambda s: _asgi_app())

    async def no_main_loop(self):  # up, announced, then straight to shutdown
        return None

    monkeypatch.setattr(cli.AnnouncingServer, "main_loop", no_main_loop)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with caplog.at_level(logging.INFO, logger=cli.__name__):
        assert cli.main(["serve", engine_checkpoint[0], "--device", "cpu", "--port", str(port)]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == cli.__name__ and "listening on" in r.getMessage()]
    assert said == [f"listening on http://127.0.0.1:{port}"]


def test_listen_url_brackets_ipv6():
    with socket.socket(socket.AF_INET6) as sock:
        try:
            sock.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback")
        assert cli.listen_url(sock) == f"http://[::1]:{sock.getsockname()[1]}"
