"""The local-disk tier: prefix KV caches demoted from DRAM into files of a local directory.

Under DRAM in the stack (``tiers.TierStack``), with its own byte budget (the bytes of its files) and
TTL. Off unless the policy names a directory (``cache.disk``).

* **Off the ranking path**: ``admit`` only queues the entry; a writer thread lays it out and writes it
  to a temporary file, then renames it into place (no fsync: the directory is a cache emptied at every
  start, and a read checks the file whole), and exits when its queue is empty. An entry still queued
  is served from memory.
* **Raw bytes, checksummed**: a file is ``MAGIC``, the lengths of a JSON layout and of the tensor
  bytes and their CRC-32, the layout (key, length, versions, each tensor's dtype, shape and offset),
  then each tensor's own bytes, aligned. No pickle: a read is one ``readinto`` and tensors over that
  buffer, a write copies nothing a contiguous entry does not need. A file that is short, torn, of
  another format or version, fails its CRC-32 or holds another key is a miss (counted in
  ``corrupt_reads`` and deleted), never a wrong score. CRC-32 catches torn and flipped bytes (what a
  cache on a local disk meets); it is no defence against someone who can write to the directory.
* **A full disk is no error on the ranking path**: a write that fails (ENOSPC or any ``OSError``) is
  counted in ``failed_writes`` and the entry dropped.

A KV with no storage (the fleet simulator's stand-in, on the ``meta`` device) is kept as accounting
only, with no file, so the simulator runs this tier's budget, TTL and order like the real one.

The directory is this instance's own: files of an earlier run are deleted when the tier starts (their
keys are not indexed, and the budget counts only what this run wrote).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import struct
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relay_engine.core.config import BYTES_PER_MIB, CacheBudget
from relay_engine.core.kvcache import CacheKey, LostHook, ignore_lost
from relay_engine.core.model import History, PrefixKV
from relay_engine.core.outcomes import Outcome, TierCounters
from relay_engine.core.telemetry import EVICTED_FROM, MissReason
from relay_engine.core.tiers import Drain, LowerTier, TierSite

log = logging.getLogger(__name__)

MAGIC = b"RGRKV\x00\x02\n"  # format name and version (2: raw tensor bytes, no pickle)
# magic, length of the JSON layout, length of the tensor bytes, CRC-32 of the layout and the tensor bytes
_HEADER = struct.Struct(f"<{len(MAGIC)}sIQI")
_ALIGN = 64  # each tensor's bytes start at a multiple of this within the file
SUFFIX = ".kv"
WRITER_NICE = 19  # the writer takes a core only when ranking and pre-inference leave it idle
# Demotions waiting for the writer are held in memory, outside any budget: past either limit a demotion
# is refused (counted in ``rejected``) rather than let a writer that falls behind grow the process.
MAX_QUEUED = 256
MAX_QUEUED_BYTES = 256 * 1024 * 1024
# The dtypes a file may name (a layout naming anything else is corrupt, never an attribute lookup).
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool)}


class CorruptEntry(ValueError):
    """A file that does not hold what its name promises."""


def _tensors(kv: PrefixKV) -> dict[str, torch.Tensor]:
    """An entry's tensors by name, on the CPU, each holding only its own elements: a view into a larger
    buffer (a slice of a preallocated slab, the benchmark's primed zeros) is copied out, so a file holds
    the entry's bytes, never its base storage's."""
    named = {"kv": kv.kv, "timestamps": kv.timestamps}
    if kv.tail is not None:
        named |= {"tail.items": kv.tail.items, "tail.actions": kv.tail.actions,
                  "tail.timestamps": kv.tail.timestamps}
    return {name: t.detach().cpu().contiguous() for name, t in named.items() if t is not None}


def _layout(key: CacheKey, kv: PrefixKV) -> list[memoryview]:
    """A file's bytes as parts written one after the other, without joining them: the header, the
    JSON layout (padded so the first tensor starts aligned), then each tensor's bytes, padded."""
    tensors = _tensors(kv)
    parts: list[memoryview] = []
    placed, offset = [], 0
    for name, t in tensors.items():
        raw = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        placed.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        parts.append(raw)
        pad = -len(raw) % _ALIGN
        if pad:
            parts.append(memoryview(bytes(pad)))
        offset += len(raw) + pad
    meta = json.dumps({"key": [key.user_id, key.prefix_digest, key.model_version, key.edit_hash],
                       "length": kv.length, "model_version": kv.model_version, "edit_hash": kv.edit_hash,
                       "tensors": placed}, separators=(",", ":")).encode()
    meta += b" " * (-(_HEADER.size + len(meta)) % _ALIGN)
    crc = zlib.crc32(meta)
    for part in parts:  # zlib releases the GIL over large buffers
        crc = zlib.crc32(part, crc)
    header = _HEADER.pack(MAGIC, len(meta), offset, crc)
    return [memoryview(header), memoryview(meta), *parts]


def encode(key: CacheKey, kv: PrefixKV) -> bytes:
    """A file's bytes: header (magic, lengths, CRC-32), the JSON layout, the raw tensor bytes."""
    return b"".join(_layout(key, kv))


def decode(key: CacheKey, data: bytes | bytearray) -> PrefixKV:
    """The PrefixKV in a file's bytes, on the CPU (its tensors share ``data``'s memory when it is a
    bytearray: no copy); CorruptEntry when they are not a whole, intact entry of key."""
    buf = memoryview(data if isinstance(data, bytearray) else bytearray(data))
    if len(buf) < _HEADER.size:
        raise CorruptEntry(f"{len(buf)} bytes, shorter than the {_HEADER.size}-byte header")
    magic, meta_len, payload_len, crc = _HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise CorruptEntry("not a RelayGR KV file of this version (bad magic)")
    start = _HEADER.size + meta_len
    if len(buf) != start + payload_len:
        raise CorruptEntry(f"{len(buf)} bytes, the header says {start + payload_len}")
    if zlib.crc32(buf[_HEADER.size:]) != crc:
        raise CorruptEntry("fails its CRC-32")
    try:
        meta = json.loads(bytes(buf[_HEADER.size:start]))
        tensors = {}
        for name, dtype_name, shape, offset in meta["tensors"]:
            dtype = _DTYPES[dtype_name]
            count = math.prod(shape)
            if count == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=start + offset).reshape(shape)
        stored_key = CacheKey(*meta["key"])
        tail = None if "tail.items" not in tensors else History(
            tensors["tail.items"], tensors["tail.actions"], tensors.get("tail.timestamps"))
        kv = PrefixKV(tensors["kv"], tensors.get("timestamps"), int(meta["length"]), str(meta["model_version"]),
                      str(meta["edit_hash"]), tail)
    except Exception as exc:  # noqa: BLE001 — a layout with a valid checksum but not ours
        raise CorruptEntry(f"layout does not decode: {exc!r}") from None
    if stored_key != key:
        raise CorruptEntry("file holds another key")
    return kv


def _read(path: Path, expected: int) -> bytearray:
    """A file's bytes in one buffer (read into, not copied; the decoded tensors share it); a file of
    another size than written is read only up to one byte past it (decode then finds it corrupt)."""
    buf = bytearray(expected + 1)
    with open(path, "rb", buffering=0) as f:
        n = f.readinto(buf)
    del buf[n:]
    return buf


@dataclass
class _DiskEntry:
    path: Path
    nbytes: int  # the file's size
    stored_at: float
    stand_in: PrefixKV | None = None  # a storage-less KV, accounted for but never written


@dataclass
class DiskTier:
    directory: Path
    budget_bytes: int
    ttl_s: float
    clock: Callable[[], float] = time.monotonic
    on_evict: Callable[[CacheKey, PrefixKV], None] | None = None  # the bottom tier: evictions are gone
    # Told of every entry lost: evicted for space, a write that failed, expired, unreadable.
    on_lost: LostHook = ignore_lost
    counters: TierCounters = field(default_factory=TierCounters)
    name = Outcome.DISK

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes must be ≥ 0, got {self.budget_bytes}")
        self.directory = Path(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"*{SUFFIX}*"):
            stale.unlink(missing_ok=True)
        self._entries: OrderedDict[CacheKey, _DiskEntry] = OrderedDict()  # written, oldest first
        self._queued: dict[CacheKey, tuple[PrefixKV, float]] = {}  # admitted, not yet written
        self._lock = threading.Lock()
        self._to_write: Drain[CacheKey] = Drain(self._lock, self._write, "disk-demotion",
                                                 nice=WRITER_NICE)  # the writer
        self.used_bytes = 0
        self._closed = False  # closed tiers take nothing more (a demotion racing a policy that removed it)

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries or key in self._queued

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries) + len(self._queued)

    def path_of(self, key: CacheKey) -> Path:
        name = hashlib.sha256("\x00".join((key.user_id, key.prefix_digest, key.model_version,
                                           key.edit_hash)).encode()).hexdigest()[:40]
        return self.directory / f"{name}{SUFFIX}"

    # --- in ----------------------------------------------------------------------------------

    def admit(self, key: CacheKey, kv: PrefixKV) -> bool:
        """Queue an entry demoted from DRAM for the writer thread; False when the queue is full or the
        entry is larger than the whole budget. Never blocks on the disk."""
        start = False
        with self._lock:
            if (self._closed or kv.nbytes > self.budget_bytes or len(self._to_write) >= MAX_QUEUED
                    or sum(q.nbytes for q, _ in self._queued.values()) + kv.nbytes > MAX_QUEUED_BYTES):
                self.counters.rejected += 1
                return False
            self._drop_written(key)
            # Queued again even when an older version is queued or being written: the writer skips a
            # key whose version it holds is no longer the queued one, and writes the newest once.
            self._queued[key] = (kv, self.clock())
            self.counters.admissions += 1
            start = self._to_write.put(key)
        if start:
            self._to_write.start()
        return True

    def _write(self, key: CacheKey) -> None:
        """In the writer thread: write key's queued version to its file."""
        with self._lock:
            queued = self._queued.get(key)
        if queued is None:
            return  # promoted, discarded or already written while queued
        kv, stored_at = queued
        path = self.path_of(key)
        if kv.kv.is_meta:
            self._keep_stand_in(key, queued)
            return
        try:
            parts = _layout(key, kv)
        except Exception:  # noqa: BLE001 — an entry that cannot be serialised is dropped, the tier lives on
            log.exception("serialising %s for the disk tier failed; the entry is dropped", key.user_id)
            self._forget_queued(key, queued, failed=True)
            return
        with self._lock:
            if self._queued.get(key) is not queued:
                return
            nbytes = sum(len(part) for part in parts)
            fits = self._make_room(nbytes)
        if not fits:
            self._forget_queued(key, queued, rejected=True)
            return
        try:
            self._write_file(path, parts)
        except OSError as exc:  # ENOSPC, EIO, a vanished directory: counted, the entry dropped
            log.warning("writing %s to the disk tier failed (%s); the entry is dropped", key.user_id, exc)
            self._forget_queued(key, queued, failed=True)
            return
        with self._lock:
            if self._queued.get(key) is not queued:  # promoted or discarded while it was written
                path.unlink(missing_ok=True)
                return
            del self._queued[key]
            self._entries[key] = _DiskEntry(path, nbytes, stored_at)
            self.used_bytes += nbytes
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)

    def _keep_stand_in(self, key: CacheKey, queued: tuple[PrefixKV, float]) -> None:
        kv, stored_at = queued
        with self._lock:
            if self._queued.get(key) is not queued or not self._make_room(kv.nbytes):
                if self._queued.pop(key, None) is not None:
                    self.on_lost([key], EVICTED_FROM[self.name])
                return
            del self._queued[key]
            self._entries[key] = _DiskEntry(self.path_of(key), kv.nbytes, stored_at, stand_in=kv)
            self.used_bytes += kv.nbytes
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)

    def _write_file(self, path: Path, parts: list[memoryview]) -> None:
        """Write the parts to path whole or not at all: a temporary file renamed into place.

        Not fsynced: the files are a cache this instance empties at every start, and a read checks its
        CRC-32, so a file a crash tore is a miss at worst; a sync would only cost the writer's time."""
        tmp = path.with_name(path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _forget_queued(self, key: CacheKey, queued: tuple[PrefixKV, float], *, failed: bool = False,
                       rejected: bool = False) -> None:
        with self._lock:
            if self._queued.get(key) is queued:
                del self._queued[key]
                self.on_lost([key], EVICTED_FROM[self.name])
                self.counters.failed_writes += failed
                self.counters.rejected += rejected

    def _make_room(self, nbytes: int) -> bool:
        """Delete the oldest files until nbytes more fit (lock held); False when they never would."""
        if nbytes > self.budget_bytes:
            return False
        while self.used_bytes + nbytes > self.budget_bytes and self._entries:
            victim_key, victim = self._entries.popitem(last=False)
            self.used_bytes -= victim.nbytes
            self._delete(victim)
            self.counters.evictions += 1
            self.on_lost([victim_key], EVICTED_FROM[self.name])
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every admitted entry is written (or dropped); False on timeout."""
        return self._to_write.flush(timeout_s)

    # --- out ---------------------------------------------------------------------------------

    def lookup(self, key: CacheKey) -> PrefixKV | None:
        """Take key's KV out of the tier (from memory while its write is queued, else read back and
        verified; the file is deleted either way); None when absent, expired or corrupt."""
        with self._lock:
            queued = self._queued.pop(key, None)
            entry = None if queued is not None else self._entries.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.nbytes
        if queued is not None:
            kv, stored_at = queued
            return self._served(key, kv, stored_at)
        if entry is None:
            return None
        if entry.stand_in is not None:
            return self._served(key, entry.stand_in, entry.stored_at)
        try:
            data = _read(entry.path, entry.nbytes)
        except OSError as exc:
            log.warning("reading %s from the disk tier failed (%s): a miss", key.user_id, exc)
            data = bytearray()
        finally:
            entry.path.unlink(missing_ok=True)
        if self.clock() - entry.stored_at > self.ttl_s:
            return self._served(key, None, entry.stored_at)
        try:
            kv = decode(key, data)
        except CorruptEntry as exc:
            log.warning("disk tier entry of %s is corrupt (%s): a miss", key.user_id, exc)
            with self._lock:
                self.counters.corrupt_reads += 1
                self.on_lost([key], MissReason.UNREADABLE)
            return None
        return self._served(key, kv, entry.stored_at)

    def _served(self, key: CacheKey, kv: PrefixKV | None, stored_at: float) -> PrefixKV | None:
        with self._lock:
            if kv is None or self.clock() - stored_at > self.ttl_s:
                self.counters.expirations += 1
                self.on_lost([key], MissReason.EXPIRED)
                return None
            self.counters.hits += 1
            return kv

    def discard(self, key: CacheKey) -> None:
        with self._lock:
            self._queued.pop(key, None)
            self._drop_written(key)

    def expire(self) -> int:
        with self._lock:
            now = self.clock()
            stale = [k for k, e in self._entries.items() if now - e.stored_at > self.ttl_s]
            for k in stale:
                self._drop_written(k)
            self.counters.expirations += len(stale)
            self.on_lost(stale, MissReason.EXPIRED)
            return len(stale)

    def resize(self, budget_bytes: int, ttl_s: float) -> None:
        with self._lock:
            self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
            self._make_room(0)

    def clear(self) -> list[CacheKey]:
        """Drop every entry, queued or written; returns their keys."""
        with self._lock:
            dropped = [*self._queued, *self._entries]
            self._queued.clear()
            for k in list(self._entries):
                self._drop_written(k)
            return dropped

    def close(self) -> None:
        """Let queued writes finish, then delete every file and the directory if that leaves it empty
        (the tier does not outlive its instance)."""
        with self._lock:
            self._closed = True
        self.flush(timeout_s=30)
        self.clear()
        with contextlib.suppress(OSError):  # not empty (someone else's files), or already gone
            self.directory.rmdir()

    def _drop_written(self, key: CacheKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used_bytes -= entry.nbytes
            self._delete(entry)

    @staticmethod
    def _delete(entry: _DiskEntry) -> None:
        if entry.stand_in is not None:
            return
        try:
            entry.path.unlink(missing_ok=True)
        except OSError as exc:
            log.warning("deleting %s failed (%s)", entry.path, exc)


def _build(cache: CacheBudget, site: TierSite, current: DiskTier | None) -> DiskTier | None:
    """The disk tier while the policy names a directory: the one the engine runs if it keeps its files
    there, resized, else a new one; None (off) without ``cache.disk``."""
    policy = cache.disk
    if policy is None:
        return None
    # The policy names a directory for the pool; each instance keeps its files in its own below it.
    directory = Path(policy.path) / re.sub(r"[^A-Za-z0-9._-]", "_", site.engine_name)
    budget_bytes = int(policy.budget_mb * BYTES_PER_MIB)
    tier = current
    if tier is None or tier.directory != directory:
        tier = DiskTier(directory, budget_bytes, policy.ttl_ms / 1000, clock=site.clock)
    tier.resize(budget_bytes, policy.ttl_ms / 1000)
    return tier


def _check(cache: CacheBudget) -> tuple[str, str] | None:
    """The directory the policy names must exist (it is created) and be writable here."""
    policy = cache.disk
    if policy is None:
        return None
    try:
        os.makedirs(policy.path, exist_ok=True)
    except OSError as exc:
        return "cache.disk.path", f"cannot create {policy.path!r}: {exc.strerror}"
    if not os.access(policy.path, os.W_OK | os.X_OK):
        return "cache.disk.path", f"{policy.path!r} is not a writable directory"
    return None


LOWER_TIER = LowerTier(Outcome.DISK, build=_build, check=_check)
