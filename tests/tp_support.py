"""Run a function on every rank of a small torch.distributed (gloo) group of spawned processes.

``RankPool(world_size)`` spawns the processes once (each with one torch thread, joined over a free
localhost TCP port) and keeps them for many calls: ``pool.run(fn, *args)`` calls
``fn(tp, *args)`` on every rank (``tp`` the rank's lora_runner.distributed.TensorParallel) and
returns the ranks' results in rank order. ``fn`` must be importable by name (a module-level function
of a test module). A rank's exception is raised in the caller with that rank's traceback; a rank
that dies, or a call that runs past its timeout (a rank stuck in a collective the other left), is
an error too, never a hang: the pool then terminates its processes and the next call starts fresh
ones.
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from lora_runner.distributed import TensorParallel

COLLECTIVE_TIMEOUT_S = 30  # gloo gives up on a collective a peer never joins after this long
CALL_TIMEOUT_S = 120  # one run() (model loads included) on 2 busy cores


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback."""


def free_port() -> int:
    """A TCP port free on localhost right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, tasks, results) -> None:
    """A rank's loop: join the group, then run each (fn, args) from ``tasks`` until None comes."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    tp = TensorParallel(rank=rank, world_size=world_size)
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, fn(tp, *args)))
            except BaseException:  # noqa: BLE001 - every failure goes back to the test, as text
                results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


class RankPool:
    """``world_size`` rank processes in one gloo group, kept across calls (see module docstring)."""

    def __init__(self, world_size: int = 2) -> None:
        self.world_size = world_size
        self._procs: list = []

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        port = free_port()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._results = context.Queue()
        self._procs = [context.Process(target=_serve, args=(rank, self.world_size, port, self._tasks[rank],
                                                            self._results), daemon=True)
                       for rank in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args, timeout: float = CALL_TIMEOUT_S) -> list:
        """``[fn(tp_0, *args), fn(tp_1, *args), ...]``; RankError when a rank raises, dies or times out."""
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        results: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"rank(s) {dead} died" if dead else f"no result within {timeout} s"
                    raise RankError(f"{fn.__name__}: {why}") from None
                continue
            if not ok:
                self.close()  # the other ranks may be stuck in a collective: start afresh next time
                raise RankError(f"{fn.__name__} raised on rank {rank}:\n{value}")
            results[rank] = value
        return [results[rank] for rank in range(self.world_size)]

    def close(self) -> None:
        """Stop the rank processes (asked first, then terminated)."""
        for proc, tasks in zip(self._procs, self._tasks):
            if proc.is_alive():
                tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._procs = []
