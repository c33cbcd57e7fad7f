"""Device and dtype resolution ("auto" included), shared by the engine config, the KV cache and the loader;
and what the host offers the engine: available RAM and physical CPU cores."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "half": torch.float16,
           "float": torch.float32}


def resolve_device(device: torch.device | str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else goes through torch.device."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"invalid device {device!r}: expected 'auto', 'cpu', 'cuda', 'cuda:N'") from err


def resolve_dtype(dtype: torch.dtype | str, device: torch.device | str) -> torch.dtype:
    """A torch.dtype or 'float32'/'float16'/'bfloat16'/'auto' (auto: bf16 on CUDA, else fp32)."""
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        on_cuda = resolve_device(device).type == "cuda"
        resolved = torch.bfloat16 if on_cuda else torch.float32
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ValueError(f"unsupported dtype {dtype!r}: use a torch dtype or 'float32', 'float16', "
                         "'bfloat16', 'auto'")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {resolved}: use float32, float16 or bfloat16")
    return resolved


def available_host_memory() -> int:
    """Bytes of RAM available to new allocations now (psutil: free plus reclaimable page cache)."""
    import psutil

    return int(psutil.virtual_memory().available)


def available_cpu_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask (os.sched_getaffinity)
    over the hardware threads per core, at most the cgroup CPU quota (containers); at least 1."""
    import psutil

    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    physical_total, logical_total = psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)
    per_core = logical_total // physical_total if physical_total and logical_total else 1
    return max(1, min(logical // max(per_core, 1), _cgroup_cpu_quota() or logical))


def _cgroup_cpu_quota() -> int | None:
    """CPUs the cgroup's quota allows (rounded up), None when unlimited or unknown."""
    v2 = _read("/sys/fs/cgroup/cpu.max")  # "max 100000" or "<quota> <period>"
    if v2 is not None:
        quota, _, period = v2.strip().partition(" ")
    else:  # cgroup v1; quota -1 means unlimited
        quota, period = _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):  # "max" or no file
        return None
    return -(-quota // period) if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return None


def choose_cpu_threads(requested: int | None) -> tuple[int, str]:
    """(intra-op threads, why): `requested` when set, else the physical cores available to the
    process (available_cpu_cores), never more than torch's current setting (which OMP_NUM_THREADS
    or an earlier torch.set_num_threads may have lowered)."""
    cores = available_cpu_cores()
    if requested is not None:
        return requested, f"cpu_threads={requested}; {cores} physical core(s) available"
    current = torch.get_num_threads()
    if current < cores:
        return current, (f"torch's current setting (OMP_NUM_THREADS or an earlier torch.set_num_threads), "
                         f"under the {cores} physical core(s) available")
    return cores, "the physical core(s) available to this process (affinity, SMT, cgroup quota)"


def set_cpu_threads(requested: int | None) -> int:
    """Apply choose_cpu_threads(requested) with torch.set_num_threads and log it; returns the count.

    torch.set_num_threads is process-global: everything else in the process runs with it too."""
    threads, why = choose_cpu_threads(requested)
    cores = available_cpu_cores()
    if threads > cores:
        logger.warning("cpu_threads=%d is more than the %d physical core(s) available: threads will wait "
                       "for each other at every parallel region", threads, cores)
    torch.set_num_threads(threads)
    logger.info("CPU intra-op threads: %d (%s); torch.set_num_threads is process-global", threads, why)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if requested is None and threads > 1 and load >= cores:
        logger.info("the machine is busy (1-minute load average %.1f for %d core(s)): while other processes "
                    "compete for the cores, cpu_threads=1 can be several times faster (threads wait for each "
                    "other at every parallel region; see bench_engine.py --contention)", load, cores)
    return threads
