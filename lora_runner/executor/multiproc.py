"""MultiprocExecutor: one worker process per tensor-parallel rank, one message per step.

Each step: take the queued ops (slot writes and clears, freed rows, end ids), pickle them with the
runner's part of the SchedulerOutput once (lora_runner.executor.step_message), send the same bytes down
every rank's pipe, then wait for every rank's reply; rank 0's is the SamplerOutput (every rank's must
sample the same tokens: a rank that disagrees makes the executor dead). Adapter weights do
not ride in the message: each version is written once to shared memory (lora_runner.executor.
shared_weights) and named by a handle.

A worker that exits, fails a step or does not answer within ``step_timeout_s`` makes ``execute`` raise
EngineDeadError; every worker is then stopped (pipe closed, terminate, kill), so none is left behind.
``close()``, the executor's garbage collection and interpreter exit stop them the same way; workers
also stop by themselves when the engine's process dies (lora_runner.executor.worker_main).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import weakref
from multiprocessing.connection import wait

import torch.multiprocessing as mp

from lora_runner.executor.errors import EngineDeadError
from lora_runner.executor.ranked import RankedExecutor
from lora_runner.executor.shared_weights import SharedWeights
from lora_runner.executor.worker_main import worker_main
from lora_runner.executor.worker_spec import WorkerSpec

STOP_GRACE_S = 3.0  # how long a closing executor waits for workers to exit on their own before killing them


class MultiprocExecutor(RankedExecutor):
    """``world_size`` workers (spawned) that build their rank from ``spec``.

    Attributes: ``processes`` (the worker processes), ``counts`` (Counter: "messages" sent steps,
    "pickles" payloads pickled, "sends" pipe writes), ``shared`` (SharedWeights: ``files_created``).
    ``slot_proxy(kind)`` makes the engine-side slots of an adapter kind ("lora", "vocab", "prompt") for
    AdapterManager(make_slots=...). Raises RuntimeError when a worker fails to start (its traceback
    in the message); no worker is left running then.
    """

    def __init__(self, spec: WorkerSpec, world_size: int) -> None:
        super().__init__(spec, world_size)
        context = mp.get_context("spawn")
        port = _free_port()
        self.processes, self._conns = [], []
        for rank in range(world_size):
            parent_end, child_end = context.Pipe(duplex=True)
            process = context.Process(target=worker_main, name=f"lora-runner-tp{rank}", daemon=True,
                                      args=(rank, world_size, port, spec, child_end, os.getpid()))
            process.start()
            child_end.close()  # the child holds its end: the parent's copy would hide the child's exit
            self.processes.append(process)
            self._conns.append(parent_end)
        self._finalizer = weakref.finalize(self, _stop_workers, self.processes, self._conns, self.shared)
        try:
            ready = self._gather(spec.startup_timeout_s, "start")
        except EngineDeadError as error:
            raise RuntimeError(f"tensor-parallel workers failed to start: {error}") from error
        self.slot_nbytes = {kind: sum(r[kind] for r in ready) for kind in ("lora", "prompt")}

    def is_alive(self) -> bool:
        """True while no step failed and every worker runs."""
        return self._dead is None and all(process.is_alive() for process in self.processes)

    def close(self) -> None:
        """Stop every worker (pipe closed, then terminate and kill after STOP_GRACE_S) and remove the shared
        weight files; idempotent."""
        self._finalizer()

    # ------------------------------------------------------------------------- one message
    def _deliver(self, payload: bytes) -> list:
        """The same bytes down every rank's pipe, then every rank's reply."""
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
                self.counts["sends"] += 1
        except (BrokenPipeError, OSError) as error:
            self._die(f"a worker's pipe broke: {error!r}")
        return self._gather(self.spec.step_timeout_s, "step")

    def _gather(self, timeout: float, what: str) -> list:
        """Every rank's reply (in rank order) within ``timeout`` s; EngineDeadError otherwise."""
        deadline, replies = time.monotonic() + timeout, [None] * self.world_size
        pending = dict(enumerate(self._conns))
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes)}
        while pending:
            remaining = deadline - time.monotonic()
            ready = wait([*pending.values(), *sentinels], timeout=max(0.0, remaining)) if remaining > 0 else []
            if not ready:
                self._die(f"no answer from rank(s) {sorted(pending)} within {timeout:.1f} s ({what})")
            for rank, conn in list(pending.items()):
                if conn in ready:
                    replies[rank] = self._receive(rank, conn)
                    del pending[rank]
            for sentinel, rank in sentinels.items():
                if sentinel in ready and rank in pending:  # exited without answering
                    code = self.processes[rank].exitcode
                    self._die(f"tensor-parallel worker {rank} (pid {self.processes[rank].pid}) exited "
                              f"with code {code} ({what})")
        return replies

    def _receive(self, rank: int, conn):
        try:
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as error:
            self._die(f"tensor-parallel worker {rank} closed its pipe: {error!r}")
        status, value, *rest = reply
        if status == "error":
            self._die(f"tensor-parallel worker {rank} failed:\n{value}")
        if rest:
            self.rank_messages[rank] = rest[0]
        return value


def _stop_workers(processes, conns, shared: SharedWeights) -> None:
    """Close the pipes (workers exit on EOF), then terminate and kill what is left; reap every process."""
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        if process.is_alive():
            process.kill()
            process.join()
    shared.close()


def _free_port() -> int:
    """A localhost TCP port nothing listens on now (rank 0's store binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
