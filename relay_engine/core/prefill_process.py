"""Prefills in a process of their own, on the CPU: pre-inference that shares neither the interpreter
lock nor a scheduling entity with ranking.

On the CPU the pre-inference lane's nice value weighs its thread against ranking's where they share
a core, but a thread shares the instance's one interpreter lock: a small model's prefill spends about
40 % of its time in Python holding it (py-spy under ``workers.bench_roundtrip``'s backlog), so a rank
waits for the lock at every op it dispatches, whatever the nice value says, and ranking P99 under a
backlog of prefills was 2.0–3.4× of without. In a child process the prefill's Python runs under its
own lock, and the child's nice value (the lane's share, ``lane.nice_for_share``) is what weighs it
against ranking where the two share a core. The lane thread only waits on the pipe, which holds no
lock. Off by default (``RELAYGR_PREFILL_PROCESS``): freed from the lock the child takes a whole core,
and on a 2-core machine, where there is none to spare, ranking's backlog ratio measured worse with
it (2.1–2.3×) than on the lane thread (1.8×); see the README.

    process = PrefillProcess(model, nice=5)        # the child starts now (spawn: it imports torch, ~1–2 s)
    kv, cpu_ms, wall_ms = process.prefill(prefix, edit)   # blocks the calling thread, not the others
    process.set_nice(10); process.close()

The model's weights are shared with the child (``share_memory``: one copy in memory, not two), and the
child computes exactly what ``HSTUModel.prefill`` computes in the parent (same weights, same code,
same version); it only runs without the ranking gate's yield points, which exist for the lock this
design removes. Tokens and caches cross the pipe as numpy arrays (a 256-token prefix's cache is
0.13 MB on the small model, 1 MB on the default one); an edit crosses once per content hash. A
child that dies, or answers nothing within ``timeout_s``, fails that prefill (``PrefillProcessError``,
which the engine counts as a failed computation) and is replaced at the next one. A nice value can
be raised on a running child but not lowered (that needs privileges), so a larger share starts a
fresh child, as the lane does with a fresh thread.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import threading
import time
from typing import Any

import torch
import torch.multiprocessing as torch_mp

from relay_engine.core import devices
from relay_engine.core.lane import SharePacer, YieldEveryOp, nice_for_share
from relay_engine.core.model import EditTensors, History, HSTUModel, PrefixKV

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # a cold child imports torch: seconds on a loaded machine
PREFILL_TIMEOUT_S = 60.0
POLL_S = 0.0002  # how often a pausing child looks whether ranking has ended
SHM_DIR = "/dev/shm"
SHM_MARGIN = 1.5


class PrefillProcessError(RuntimeError):
    """The prefill child died, hung or could not start; the prefill it was given did not happen."""


def _history_out(h: History | None) -> tuple | None:
    if h is None:
        return None
    return h.items.numpy(), h.actions.numpy(), None if h.timestamps is None else h.timestamps.numpy()


def _history_in(wire: tuple | None) -> History | None:
    if wire is None:
        return None
    items, actions, ts = wire
    return History(torch.from_numpy(items), torch.from_numpy(actions), None if ts is None else torch.from_numpy(ts))


def _kv_out(kv: PrefixKV) -> tuple:
    ts = None if kv.timestamps is None else kv.timestamps.numpy()
    return kv.kv.numpy(), ts, kv.length, kv.model_version, kv.edit_hash, _history_out(kv.tail)


def _kv_in(wire: tuple) -> PrefixKV:
    kv, ts, length, version, edit_hash, tail = wire
    return PrefixKV(torch.from_numpy(kv), None if ts is None else torch.from_numpy(ts), length, version, edit_hash,
                    _history_in(tail))


def _pacer(ranking_active, share: float) -> SharePacer:
    """The child's yield points (``RankingGate.pacer`` across the process boundary): ``ranking_active``
    is the parent's gate count in shared memory, polled while the prefill waits."""

    def wait_idle(timeout_s: float | None) -> bool:
        end = None if timeout_s is None else time.perf_counter() + timeout_s
        while ranking_active.value:
            left = POLL_S if end is None else end - time.perf_counter()
            if left <= 0:
                return False
            time.sleep(min(left, POLL_S))
        return True

    return SharePacer(share, lambda: ranking_active.value > 0, wait_idle)


def _child(conn, model: HSTUModel, nice: int, threads: int, ranking_active) -> None:
    """The child's loop: ("edit", EditTensors) keeps an edit; ("prefill", tokens, edit hash, share)
    answers ("ok", cache, cpu ms, wall ms) or ("error", message). Ends when the parent closes the pipe."""
    # Its life is the pipe's: Ctrl-C or a TERM sent to the whole group is the parent's to handle (a
    # warm shutdown that finishes the prefill in hand); the parent's exit closes the pipe, and this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    devices.keep_freed_host_memory()
    torch.set_num_threads(threads)
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    edits: dict[str, EditTensors] = {}
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        if message[0] == "edit":
            edit: EditTensors = message[1]
            edits = {edit.content_hash: edit}  # one edit in force at a time; an older one is never asked for
            continue
        _, tokens, edit_hash, share = message
        try:
            t_cpu, t_wall = time.thread_time(), time.perf_counter()
            pace = _pacer(ranking_active, share)
            with YieldEveryOp(pace, pace.ranking):
                kv = model.prefill(_history_in(tokens), edits.get(edit_hash), between_layers=pace)
            reply = ("ok", _kv_out(kv), (time.thread_time() - t_cpu) * 1000, (time.perf_counter() - t_wall) * 1000)
        except Exception as exc:  # noqa: BLE001 — the parent raises it; the child serves on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def check_shared_memory(model: HSTUModel, where: str = SHM_DIR) -> None:
    """Raise PrefillProcessError unless ``where`` (the tmpfs that shared tensors live in) has room for
    the model's weights with a margin: a full tmpfs would not fail the copy, it would kill the
    process with SIGBUS when the copy touches a page it cannot have."""
    need = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    try:
        stat = os.statvfs(where)
    except OSError:
        return  # no such tmpfs here: torch shares another way, and says so if it cannot
    free = stat.f_bavail * stat.f_frsize
    if free < need * SHM_MARGIN:
        raise PrefillProcessError(f"{where} has {free / 2**20:.0f} MiB free, the model's weights need "
                                  f"{need / 2**20:.0f} MiB (with a {SHM_MARGIN:g}× margin); give the container "
                                  f"more (docker: shm_size) or set RELAYGR_PREFILL_PROCESS=off")


class PrefillProcess:
    """One child process running prefills for one engine, one at a time, in the order asked."""

    def __init__(self, model: HSTUModel, *, share: float, threads: int = 1, name: str = "prefill",
                 timeout_s: float = PREFILL_TIMEOUT_S):
        if model.device.type != "cpu":
            raise ValueError(f"a prefill process serves a CPU model, not one on {model.device}")
        check_shared_memory(model)
        model.share_memory()  # the child maps these weights rather than copying them
        self.model, self.threads, self.name, self.timeout_s = model, threads, name, timeout_s
        self.share = share
        self._nice = nice_for_share(share)
        # How many ranks the parent is running (its ``RankingGate`` writes it; the child reads it).
        self.ranking_active = torch_mp.get_context("spawn").RawValue("i", 0)
        self._lock = threading.Lock()
        self._proc: Any = None
        self._conn: Any = None
        self._child_nice = self._nice
        self._edit_sent: str | None = None
        self.restarts = 0
        with self._lock:
            self._start()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        ctx = torch_mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_child, args=(child, self.model, self._nice, self.threads, self.ranking_active),
                                 name=self.name, daemon=True)
        self._proc.start()
        child.close()
        self._conn, self._child_nice, self._edit_sent, self._ready = parent, self._nice, None, False

    def _await_ready(self) -> None:
        if self._ready:
            return
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop()
            raise PrefillProcessError(f"{self.name}: the prefill process did not start within {START_TIMEOUT_S:.0f} s")
        self._recv()
        self._ready = True

    def _recv(self) -> tuple:
        try:
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError) as exc:
            code = self._proc.exitcode if self._proc is not None else None
            self._stop()
            raise PrefillProcessError(f"{self.name}: the prefill process ended (exit code {code})") from exc

    def _stop(self) -> None:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()  # the child's recv ends: it returns
        if proc is not None:
            proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)

    def set_share(self, share: float) -> None:
        """The compute share from the next prefill on: the child's nice value (raised in place; a
        lower one starts a fresh child) and its pause at yield points while ranking runs."""
        nice = nice_for_share(share)
        with self._lock:
            self.share, self._nice = share, nice
            if self._proc is not None and nice > self._child_nice:
                try:
                    os.setpriority(os.PRIO_PROCESS, self._proc.pid, nice)
                    self._child_nice = nice
                except OSError as exc:
                    log.warning("%s: cannot set nice %d on the prefill process (%s)", self.name, nice, exc)

    def prefill(self, prefix: History, edit: EditTensors | None = None) -> tuple[PrefixKV, float, float]:
        """The prefix's cache, computed in the child, with the child's CPU and wall milliseconds.
        Raises the model's own errors as ``PrefillProcessError`` naming them, or when the child fails."""
        with self._lock:
            if self._proc is None or self._nice < self._child_nice:
                if self._proc is not None:  # a lower nice: a fresh child at the new one
                    self._stop()
                self._start()
                self.restarts += 1
            self._await_ready()
            edit_hash = "none" if edit is None else edit.content_hash
            try:
                if edit is not None and edit_hash != self._edit_sent:
                    self._conn.send_bytes(pickle.dumps(("edit", edit), protocol=pickle.HIGHEST_PROTOCOL))
                    self._edit_sent = edit_hash
                self._conn.send_bytes(pickle.dumps(("prefill", _history_out(prefix.to(torch.device("cpu"))),
                                                    edit_hash, self.share), protocol=pickle.HIGHEST_PROTOCOL))
            except (OSError, ValueError) as exc:
                self._stop()
                raise PrefillProcessError(f"{self.name}: could not reach the prefill process ({exc})") from exc
            if not self._conn.poll(self.timeout_s):
                self._stop()
                raise PrefillProcessError(f"{self.name}: no answer within {self.timeout_s:.0f} s; the prefill "
                                          f"process was stopped and is replaced at the next prefill")
            reply = self._recv()
        if reply[0] == "error":
            raise PrefillProcessError(f"{self.name}: {reply[1]}")
        _, kv, cpu_ms, wall_ms = reply
        return _kv_in(kv), cpu_ms, wall_ms

    def close(self) -> None:
        with self._lock:
            self._stop()


class ProcessPrefillForwards:
    """``engine.Forwards`` whose prefills run in a ``PrefillProcess`` (timed there, into ``times``);
    ranking's passes run on ``inner``, in the calling thread, as before."""

    def __init__(self, inner, process: PrefillProcess, times) -> None:
        self.inner, self.process, self.times = inner, process, times
        self.rank = inner.rank
        self.rank_full = inner.rank_full
        self.rank_full_keeping_prefix = inner.rank_full_keeping_prefix

    def prefill(self, prefix: History, edit: EditTensors | None = None, *, between_layers=None) -> PrefixKV:
        kv, cpu_ms, wall_ms = self.process.prefill(prefix, edit)
        self.times.record("prefill", len(prefix), 0, 0, cpu_ms, wall_ms)
        return kv
