"""Child processes that die with their parent, even when the parent is killed with SIGKILL.

A parent that exits normally stops its children itself (the stack, the pool, the test helpers all
do); one that is killed gets no chance to, and an embedded ``redis-server``, a worker instance or a
simulator run would outlive it, holding ports, memory and CPU. On Linux the kernel can send a signal
to a child when its parent dies (``prctl(PR_SET_PDEATHSIG)``); the setting survives ``execve``, so
it is made once, in the child between ``fork`` and ``exec`` (``preexec_fn=die_with_parent()``), or
first thing in a ``multiprocessing`` child (``follow_parent(parent_pid)``).

Two details of the kernel's rule matter: the signal follows the parent *thread* that forked the
child, so spawn long-lived children from a thread that lives as long as they should (the main
thread, or one that waits for the child); and a parent that died before the child set the signal is
caught by comparing ``getppid()`` with the pid the parent had. Elsewhere than Linux both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc.prctl


# Resolved once, before any fork: the child only makes the call (no imports, no locks after fork).
_PRCTL = _load_prctl()


def follow_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child: have the kernel send ``sig`` when the parent dies; exit at once if it already has."""
    if _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that binds the child's life to this process's.

    ``None`` where the platform has no such call (Popen then runs no preexec function at all)."""
    if _PRCTL is None:
        return None
    parent_pid = os.getpid()

    def preexec() -> None:
        follow_parent(parent_pid, sig)

    return preexec


def free_port() -> int:
    """A loopback TCP port free now, for a child process to listen on (the embedded Redis, a Prometheus)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
