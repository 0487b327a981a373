"""A pool's forward times over a window: what its own devices measure, for previews and operators.

Each instance appends a cumulative ``ForwardTimesRecord`` every ``wire.FORWARD_TIMES_EVERY_S`` to a
short stream of its own and every ``wire.FORWARD_TIMES_COARSE_EVERY_S`` to a long one. Its forwards over
a window are its newest record less the last one of either stream before the window began (or, when
its run began inside the window, the newest alone): a window of up to 2.5 min to the nearest 30 s, a
longer one to the nearest 10 min (``from``: where the counted forwards begin). The pool's are the sum
over its instances of the model most of them run. Redis is untrusted: an entry that breaks the
contract is reported by instance and left out, never a 500.
"""

from __future__ import annotations

import time
from collections import Counter

import redis

from relay_engine.core.forward_times import (
    ForwardTimes,
    ForwardTimesError,
    ForwardTimesRecord,
    bucket_bounds,
    merged,
)
from relay_engine.core.wire import FORWARD_TIMES_EVERY_S, FORWARD_TIMES_MAX_WINDOW_S, PoolKeys, live_members

from ..common.redis import bytes_client
from .history import reporting_instances

# The windows a fit may use: at most what the streams keep.
MAX_WINDOW_S = FORWARD_TIMES_MAX_WINDOW_S
DEFAULT_WINDOW_S = 900


def _entry_id(entry: tuple) -> tuple[int, int]:
    raw = entry[0].decode() if isinstance(entry[0], bytes) else str(entry[0])
    ms, _, seq = raw.partition("-")
    return int(ms), int(seq or 0)


def _latest(*answers: list) -> tuple | None:
    """The latest entry of some XREVRANGE … COUNT 1 answers (by stream id: the time it was written)."""
    entries = [answer[0] for answer in answers if answer]
    return max(entries, key=_entry_id, default=None)


def _record(entry: tuple | None) -> ForwardTimesRecord | None | str:
    """A stream entry decoded; None when there is none; the reason when it breaks the contract."""
    if entry is None:
        return None
    try:
        return ForwardTimesRecord.from_entry(entry[1])
    except (ForwardTimesError, ValueError, AttributeError, TypeError) as exc:
        return str(exc)[:200]


def pool_forward_times(client: redis.Redis, *, pool: str, window_s: int = DEFAULT_WINDOW_S,
                       now: float | None = None) -> dict:
    """The pool's forwards over the last ``window_s`` seconds: merged buckets (``ops``, the wire form of
    ``ForwardTimes``) of the instances that run the model most of them run, and what they were
    measured on; ``unreadable`` names each instance whose record could not be read and why."""
    now = time.time() if now is None else now
    window_s = max(FORWARD_TIMES_EVERY_S, min(int(window_s), MAX_WINDOW_S))
    keys = PoolKeys(pool)
    start = now - window_s
    names = sorted(set(reporting_instances(client, keys, start)) | set(live_members(client, keys, now=now)[0]))
    # The records are deflated bytes: read with a client that leaves them so.
    pipe = bytes_client(client).pipeline(transaction=False)
    before_id = str(int(start * 1000) - 1)
    for name in names:
        for coarse in (False, True):
            pipe.xrevrange(keys.forward_times(name, coarse=coarse), max="+", min="-", count=1)
            pipe.xrevrange(keys.forward_times(name, coarse=coarse), max=before_id, min="-", count=1)
    answers = pipe.execute() if names else []
    windows: dict[str, tuple[ForwardTimesRecord, ForwardTimes]] = {}
    unreadable: dict[str, str] = {}
    begins: dict[str, float] = {}
    for i, name in enumerate(names):
        fine_newest, fine_before, coarse_newest, coarse_before = answers[4 * i:4 * i + 4]
        newest = _record(_latest(fine_newest, coarse_newest))
        before = _record(_latest(fine_before, coarse_before))
        if isinstance(newest, str) or isinstance(before, str):
            unreadable[name] = newest if isinstance(newest, str) else before
            continue
        if newest is None or newest.ts < start:
            continue  # nothing of this instance in the window
        same_run = before is not None and before.started_at == newest.started_at
        windows[name] = (newest, newest.times.minus(before.times) if same_run else newest.times)
        begins[name] = before.ts if same_run else newest.started_at
    # One model's forwards only: a pool part-way through a model change fits the one most instances run.
    versions = Counter(record.model_version for record, _ in windows.values())
    model_version = versions.most_common(1)[0][0] if versions else None
    kept = {name: pair for name, pair in windows.items() if pair[0].model_version == model_version}
    times = merged(window for _, window in kept.values())
    devices = Counter(record.device.split(":")[0] for record, _ in kept.values())
    clocks = sorted({record.clock for record, _ in kept.values()})
    return {
        # Where the counted forwards begin: each instance's record before the window (the streams keep one
        # every 30 s, then every 10 min), or the start of a run begun inside it.
        "pool": pool, "window_s": window_s, "from": min((begins[name] for name in kept), default=start), "to": now,
        "instances": sorted(kept),
        "model_version": model_version, "device_kind": devices.most_common(1)[0][0] if devices else None,
        "clock": clocks[0] if len(clocks) == 1 else (clocks or None),
        "other_models": sorted(set(windows) - set(kept)), "unreadable": unreadable,
        "forwards": times.count, "ops": times.to_dict(), "drift": times.drift.to_dict(),
        "summary": summary(times),
    }


def summary(times: ForwardTimes) -> list[dict]:
    """A row per (op, bucket): what an operator reads (forwards, prefix lengths, mean and CV)."""
    rows = []
    for mean in times.means():
        lo, hi = bucket_bounds(mean.bucket)
        rows.append({"op": mean.op, "tokens_from": lo, "tokens_to": hi, "forwards": mean.count,
                     "mean_tokens": round(mean.n, 1), "mean_short": round(mean.s, 1),
                     "mean_candidates": round(mean.c, 1), "mean_ms": round(mean.mean_ms, 4),
                     "cv": round(mean.cv, 3), "mean_wall_ms": round(mean.mean_wall_ms, 4)})
    return rows


__all__ = ["DEFAULT_WINDOW_S", "MAX_WINDOW_S", "pool_forward_times", "summary"]
