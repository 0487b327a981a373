"""Device choice (npu → cuda → cpu) and the memory figures each backend can report."""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import sys
import threading

import torch

log = logging.getLogger(__name__)

DEVICE_ENV = "RELAYGR_DEVICE"
_KINDS = ("npu", "cuda", "cpu")


def npu_available() -> bool:
    if importlib.util.find_spec("torch_npu") is None:
        return False
    import torch_npu  # noqa: F401  (registers the "npu" device with torch)

    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def select_device(requested: str | None = None) -> torch.device:
    """The device to bind to: ``requested`` (or $RELAYGR_DEVICE) when set, else npu → cuda → cpu.

    ``requested`` may be a kind ("cuda") or a kind with an index ("cuda:1"); a device that is not
    present is an error rather than a silent fallback, so a misconfigured worker fails at start.
    """
    requested = requested or os.environ.get(DEVICE_ENV) or "auto"
    if requested == "auto":
        if npu_available():
            return torch.device("npu:0")
        if torch.cuda.is_available():
            return torch.device("cuda:0")
        return torch.device("cpu")
    kind = requested.split(":", 1)[0]
    if kind not in _KINDS:
        raise ValueError(f"device must be one of auto, npu[:N], cuda[:N], cpu; got {requested!r}")
    if kind == "npu" and not npu_available():
        raise ValueError(f"device {requested!r} requested but torch_npu is not installed or sees no NPU")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {requested!r} requested but CUDA is not available")
    device = torch.device(requested)
    if device.type in ("cuda", "npu") and device.index is None:
        device = torch.device(f"{device.type}:0")
    return device


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of an accelerator, or None on the CPU (where host RAM is the limit)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "npu":
        return torch.npu.get_device_properties(device).total_memory
    return None


def host_memory_bytes() -> int:
    """The host's physical memory (what the DRAM tier, and the CPU device's HBM tier, live in)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_allocated_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "npu":
        return torch.npu.memory_allocated(device)
    return None


def host_pinning_supported(device: torch.device) -> bool:
    """Pinned host memory makes DRAM ⇄ HBM copies asynchronous; it only exists beside an accelerator."""
    return device.type in ("cuda", "npu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def low_priority_stream(device: torch.device):
    """A context in which work is queued at the device's lowest stream priority (CUDA), so ranking on
    the default stream goes first; a no-op context where the backend has no stream priorities."""
    if device.type == "cuda":
        _, lowest = torch.cuda.Stream.priority_range()
        return torch.cuda.stream(torch.cuda.Stream(device, priority=lowest))
    return contextlib.nullcontext()


def synchronize_current_stream(device: torch.device) -> None:
    """Wait for the work this thread queued on its current stream (before another stream reads it)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "npu":
        torch.npu.current_stream(device).synchronize()


def host_identity() -> tuple[str, int]:
    """(which host, how many CPUs this process may use): the kernel's boot id, which every container
    on one machine shares (a hostname is each container's own), else the hostname; and the CPUs of
    this process's affinity. What tells the simulator which CPU instances share cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            host = f.read().strip()
    except OSError:
        host = ""
    if not host:
        import socket

        host = socket.gethostname()
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return host[:64], cpus


def lower_thread_priority(nice: int, what: str) -> bool:
    """Raise the calling thread's nice value to ``nice`` (Linux keeps one per thread; raising needs no
    privilege); False, logged, where it cannot be set."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError as exc:
        log.warning("%s: cannot set nice %d (%s); it keeps its priority", what, nice, exc)
        return False
    return True


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20
_TRIM_THRESHOLD = 256 * 2**20


def keep_freed_host_memory() -> bool:
    """Let glibc's malloc keep the memory a forward frees, so that the next forward reuses it.

    By default an allocation above glibc's mmap threshold gets fresh pages from the kernel and gives
    them back when freed; a forward's temporaries (a 2048-token prefill's [2048, 512] projection is
    4 MiB) then cost a page fault per 4 KiB every time, ~10 % of a CPU forward. Raising the mmap
    threshold to its maximum (32 MiB) and the trim threshold to 256 MiB keeps them in the heap: a
    process holds up to 256 MiB of freed memory per arena instead of returning it. Call once, at
    the start of a process that runs forwards; False (and nothing changed) where the C library is
    not glibc.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) != 1 or mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD) != 1:
        log.info("malloc: this C library refuses glibc's mmap and trim thresholds; forwards keep paying page faults")
        return False
    return True
