"""The server's listening address, bound before the model loads.

Loading a model takes from seconds to minutes; a port already taken (or a host that is not this
machine's) should be said at once, not after the load. ``serve`` binds the socket first and hands
it to uvicorn, which listens on it once the engine is ready (connections before then are refused,
not queued). Ray mode only checks the address: Ray Serve's proxy binds it itself.
"""

from __future__ import annotations

import socket


def bind_listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) (IPv6 when host has a colon), inheritable, not yet listening.
    Raises ValueError naming the address when it cannot be bound (in use, not local, no permission)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # as uvicorn does: a restarted server may bind while old connections sit in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        shown = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise ValueError(f"cannot listen on {shown}: {exc.strerror or exc} (choose another --host/--port)") from None
    sock.set_inheritable(True)
    return sock


def check_listen_address(host: str, port: int) -> None:
    """Raise ValueError unless (host, port) can be bound now (the socket is released again)."""
    bind_listen_socket(host, port).close()
