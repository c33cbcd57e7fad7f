"""The body of one tensor-parallel worker process (started with torch.multiprocessing, spawn).

It joins the torch.distributed group (gloo on CPU, nccl on CUDA), builds its RankWorker, says it is
ready, then answers one message per step on its pipe: the same bytes every rank got, applied, and a
reply (the rank's SamplerOutput) so the engine knows every rank finished, and in step. It ends
when the pipe closes (the engine closed it or died), and a watcher thread ends it when the parent
process is gone, so no worker outlives its engine. SIGINT is ignored: Ctrl-C reaches the whole process
group, and the engine decides how its workers stop.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from lora_runner.distributed import TensorParallel
from lora_runner.executor.rank_worker import RankWorker
from lora_runner.executor.step_message import decode
from lora_runner.executor.worker_spec import WorkerSpec

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def worker_main(rank: int, world_size: int, port: int, spec: WorkerSpec, conn, parent_pid: int) -> None:
    """Serve rank ``rank`` until the pipe ``conn`` closes or the parent ``parent_pid`` exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), name="parent-watch", daemon=True).start()
    torch.set_num_threads(spec.threads_per_rank)
    try:
        worker = _start(rank, world_size, port, spec)
    except Exception:  # noqa: BLE001 - reported to the engine, which fails its start-up with it
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", worker.slot_nbytes)))
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):  # the engine closed the pipe, or died
            break
        try:
            reply = ("ok", worker.apply(decode(payload)), worker.messages)
        except Exception:  # noqa: BLE001 - the engine treats a rank that failed a step as dead
            reply = ("error", traceback.format_exc(), worker.messages)
        try:
            conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        except (BrokenPipeError, OSError):
            break
    dist.destroy_process_group()


def _start(rank: int, world_size: int, port: int, spec: WorkerSpec) -> RankWorker:
    backend = "gloo" if spec.device_type == "cpu" else "nccl"
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=spec.step_timeout_s))
    return RankWorker(spec, TensorParallel(rank, world_size))


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the engine's process is gone (its pipe may still be held open elsewhere)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)
