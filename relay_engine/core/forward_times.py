"""How long the instance's own forward passes take, by operation and shape: what the control plane fits
the pool's cost model from (the what-if previews replay with it instead of an offline profile).

Every forward the engine runs on the real model (``TimedForwards``) adds one sample to the bucket of
its operation and prefix length: a count, the sum and the sum of squares of its time (the mean and the
dispersion), and the sums of its shape (prefix tokens n, short-term tokens s, candidates c: the
bucket's mean shape, where the fit evaluates its terms), and the sum of its wall time. Buckets are quarter-octaves of n (×1.19
each), narrow enough that the n² term at the mean n is within 1.5 % of its mean.

The time is the forward's own: on a CPU the calling thread's CPU time (``time.thread_time``), which
leaves out the time the thread waited for a core (the simulator models that sharing itself, so
counting it here would count it twice); on an accelerator, the wall time of the call. The wall time
is kept beside it: wall − CPU is what the thread lost to the other threads and processes of its host.

Beside the buckets, ``Drift`` keeps how a forward's time moves with time: each forward's log deviation
from its bucket's mean so far, and the products of pairs of deviations by the lag between the two
forwards (up to ``DRIFT_LAG_EDGES_S``'s last edge). On a shared CPU the speed of an instance drifts over
fractions of a second to seconds (consecutive forwards' deviations correlate 0.65-0.74 on this project's
2-core host), and a queue builds in the slow stretches: the simulator draws forward times with that
correlation (``relay_engine.lab.livefit.fit_drift``), not independently.

The sums are cumulative since the instance started (``started_at``), like the telemetry snapshots:
a reader takes the difference of two records of one run to get a window. Records travel as JSON
(``ForwardTimes.to_dict``) and are checked field by field when read (``from_dict``).
"""

from __future__ import annotations

import bisect
import json
import math
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .fields import inflated, json_value

if TYPE_CHECKING:  # the record format is the control plane's too, which never loads torch (its first request would)
    import torch

    from .model import EditTensors, History, PrefixKV

OPS = ("prefill", "rank", "rank_full")
# A bucket's sums, in this order (its wire form is this list).
SUMS = ("count", "sum_ms", "sum_sq_ms", "sum_n", "sum_s", "sum_c", "sum_wall_ms")
BUCKETS_PER_OCTAVE = 4
MAX_BUCKET = BUCKETS_PER_OCTAVE * 20  # prefixes up to 2^20 tokens; longer ones share the last bucket
FORMAT = "relaygr-forward-times/1"
_MAX_SUM = 2.0**53
# The sums travel to the microsecond (a window's mean is a difference of two sums over its count: off by
# at most 1 µs ÷ count), the counts and token sums as the integers they are: a third fewer digits than
# six decimals, and the digits are most of a record.
_WIRE_DECIMALS = 3
# A stream entry: the record's JSON, deflated (raw, no header), as bytes in field ``z``; a reader takes
# an older worker's plain JSON in field ``d`` as well. What an entry may inflate to: a record of every
# bucket of every op is ~30 KB, so past this it is no record, refused after inflating this much.
MAX_RECORD_JSON_BYTES = 256 * 1024
_WBITS = -15


# The lags (seconds) at which pairs of one instance's forwards are compared: the edges of the bins.
DRIFT_LAG_EDGES_S = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
DRIFT_RECENT = 64  # the newest forwards a new one is paired with (bounds the work per forward)
DRIFT_MIN_COUNT = 8  # a forward's deviation is taken once its bucket has this many before it
# turns: the forward's wall ÷ its own time, less 1 (about how many other threads took turns on its core
# meanwhile; 0 where the time is the wall time): how the deviation grows with it is the cost of interleaving.
DRIFT_SUMS = ("count", "sum_dev", "sum_sq_dev", "sum_turns", "sum_sq_turns", "sum_dev_turns")
_SIGNED = ("sum_dev", "sum_product", "sum_dev_turns")
PAIR_SUMS = ("pairs", "sum_product", "sum_lag_s")


class ForwardTimesError(ValueError):
    """A forward-times record that breaks the contract; the message names the field."""


class Drift:
    """Cumulative sums of how forward times drift: ``dev`` (count, sum, sum of squares of each forward's
    log deviation from its bucket's mean so far; sum and sum of squares of its turns, and the sum of
    deviation × turns, so a window's deviation regresses on its interleaving) and ``pairs``, one row
    per lag bin of
    ``DRIFT_LAG_EDGES_S`` (pairs of forwards that far apart, the sum of their deviations' products and
    of their lags). A window's covariance at a lag is its pairs' mean product less the mean deviation
    squared. Not thread-safe: ``ForwardTimes`` records under its lock."""

    def __init__(self, dev: list[float] | None = None, pairs: list[list[float]] | None = None):
        self.dev = dev if dev is not None else [0.0] * len(DRIFT_SUMS)
        self.pairs = pairs if pairs is not None else [[0.0] * len(PAIR_SUMS) for _ in DRIFT_LAG_EDGES_S[1:]]
        self._recent: deque[tuple[float, float]] = deque(maxlen=DRIFT_RECENT)

    def add(self, at_s: float, deviation: float, turns: float = 0.0) -> None:
        last = DRIFT_LAG_EDGES_S[-1]
        for t, other in self._recent:
            lag = at_s - t
            if 0 <= lag < last:
                row = self.pairs[bisect.bisect_right(DRIFT_LAG_EDGES_S, lag) - 1]
                row[0] += 1
                row[1] += deviation * other
                row[2] += lag
        self._recent.append((at_s, deviation))
        for i, value in enumerate((1.0, deviation, deviation * deviation, turns, turns * turns, deviation * turns)):
            self.dev[i] += value

    def copy(self) -> Drift:
        return Drift(list(self.dev), [list(row) for row in self.pairs])

    def merge(self, other: Drift) -> None:
        self.dev = [a + b for a, b in zip(self.dev, other.dev, strict=True)]
        self.pairs = [[a + b for a, b in zip(mine, theirs, strict=True)]
                      for mine, theirs in zip(self.pairs, other.pairs, strict=True)]

    def minus(self, earlier: Drift) -> Drift:
        """These sums less an earlier record's of the same run (one that went down counts whole)."""
        if earlier.dev[0] > self.dev[0]:
            return self.copy()
        return Drift([max(0.0, a - b) for a, b in zip(self.dev, earlier.dev, strict=True)],
                     [[max(0.0, a - b) for a, b in zip(mine, before, strict=True)]
                      for mine, before in zip(self.pairs, earlier.pairs, strict=True)])

    def to_dict(self) -> dict:
        return {"lag_edges_s": list(DRIFT_LAG_EDGES_S), "dev": [_wire_number(v) for v in self.dev],
                "pairs": [[_wire_number(v) for v in row] for row in self.pairs]}

    @classmethod
    def from_dict(cls, data: object, where: str = "drift") -> Drift:
        """Sums written by ``to_dict`` (None or {}: none); ForwardTimesError names the field."""
        if data is None or data == {}:
            return cls()
        if not isinstance(data, Mapping):
            raise ForwardTimesError(f"{where} must be an object, got {type(data).__name__}")
        if list(data.get("lag_edges_s") or []) != list(DRIFT_LAG_EDGES_S):
            raise ForwardTimesError(f"{where}.lag_edges_s must be {list(DRIFT_LAG_EDGES_S)} (this release's lag bins)")

        def row_of(value: object, names: tuple[str, ...], at: str) -> list[float]:
            if not isinstance(value, list) or len(value) != len(names):
                raise ForwardTimesError(f"{at} must be a list of {len(names)} numbers ({', '.join(names)})")
            for name, x in zip(names, value, strict=True):
                low = -_MAX_SUM if name in _SIGNED else 0
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not low <= x <= _MAX_SUM:
                    raise ForwardTimesError(f"{at}.{name} must be a number in [{low:g}, 2**53], got {str(x)[:40]!r}")
            return [float(x) for x in value]

        pairs = data.get("pairs")
        if not isinstance(pairs, list) or len(pairs) != len(DRIFT_LAG_EDGES_S) - 1:
            raise ForwardTimesError(f"{where}.pairs must be a list of {len(DRIFT_LAG_EDGES_S) - 1} rows, one per lag bin")
        return cls(row_of(data.get("dev"), DRIFT_SUMS, f"{where}.dev"),
                   [row_of(row, PAIR_SUMS, f"{where}.pairs[{i}]") for i, row in enumerate(pairs)])


def length_bucket(n: int) -> int:
    """The bucket of a prefix of n tokens: floor(4·log2 n) (0 for n ≤ 1)."""
    if n <= 1:
        return 0
    return min(MAX_BUCKET, int(math.floor(BUCKETS_PER_OCTAVE * math.log2(n))))


def bucket_bounds(bucket: int) -> tuple[int, int]:
    """The prefix lengths [lo, hi) a bucket holds."""
    return (math.ceil(2 ** (bucket / BUCKETS_PER_OCTAVE)) if bucket else 0,
            math.ceil(2 ** ((bucket + 1) / BUCKETS_PER_OCTAVE)))


@dataclass(frozen=True)
class BucketMean:
    """One bucket's figures: its forwards, their mean shape, mean time and coefficient of variation."""

    op: str
    bucket: int
    count: int
    n: float
    s: float
    c: float
    mean_ms: float
    cv: float  # standard deviation ÷ mean (0 for a single sample)
    mean_wall_ms: float  # the call's wall time: mean_ms and the time the thread waited for a core


@dataclass
class ForwardTimes:
    """Cumulative sums by (op, bucket); thread-safe to record into."""

    sums: dict[str, dict[int, list[float]]] = field(default_factory=lambda: {op: {} for op in OPS})
    drift: Drift = field(default_factory=Drift)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # pickled (a benchmark instance's report crosses a pipe): the sums alone
        copied = self.copy()
        return {"sums": copied.sums, "drift": copied.drift}

    def __setstate__(self, state: dict) -> None:
        self.sums = state["sums"]
        self.drift = state.get("drift") or Drift()
        self._lock = threading.Lock()

    def record(self, op: str, n: int, s: int, c: int, ms: float, wall_ms: float | None = None, *,
               at_s: float | None = None) -> None:
        """One forward: ``ms`` its own time, ``wall_ms`` the call's, ``at_s`` when it ended (monotonic
        seconds, ``time.perf_counter``; default now), for ``drift``."""
        wall_ms = ms if wall_ms is None else wall_ms
        if not (math.isfinite(ms) and math.isfinite(wall_ms)) or ms < 0 or wall_ms < 0:
            return
        b = length_bucket(n)
        at_s = time.perf_counter() if at_s is None else at_s
        with self._lock:
            row = self.sums[op].get(b)
            if row is None:
                row = self.sums[op][b] = [0.0] * len(SUMS)
            if row[0] >= DRIFT_MIN_COUNT and row[1] > 0 and ms > 0:
                self.drift.add(at_s, math.log(ms * row[0] / row[1]), max(0.0, wall_ms / ms - 1.0))
            row[0] += 1
            row[1] += ms
            row[2] += ms * ms
            row[3] += n
            row[4] += s
            row[5] += c
            row[6] += wall_ms

    @property
    def count(self) -> int:
        return int(sum(row[0] for per_op in self.sums.values() for row in per_op.values()))

    def copy(self) -> ForwardTimes:
        with self._lock:
            return ForwardTimes({op: {b: list(row) for b, row in per_op.items()} for op, per_op in self.sums.items()},
                                self.drift.copy())

    def merge(self, other: ForwardTimes) -> None:
        for op, per_op in other.sums.items():
            for b, row in per_op.items():
                mine = self.sums[op].setdefault(b, [0.0] * len(SUMS))
                for i, value in enumerate(row):
                    mine[i] += value
        self.drift.merge(other.drift)

    def minus(self, earlier: ForwardTimes) -> ForwardTimes:
        """This record less an earlier one of the same run (a bucket that went down counts whole)."""
        out = ForwardTimes()
        for op, per_op in self.sums.items():
            for b, row in per_op.items():
                before = earlier.sums.get(op, {}).get(b)
                diff = row if before is None or before[0] > row[0] else [x - y for x, y in zip(row, before, strict=True)]
                if diff[0] > 0:
                    out.sums[op][b] = [max(0.0, x) for x in diff]
        out.drift = self.drift.minus(earlier.drift)
        return out

    def means(self, min_count: int = 1) -> list[BucketMean]:
        """Every bucket with at least ``min_count`` forwards, by op then length."""
        out = []
        for op in OPS:
            for b in sorted(self.sums[op]):
                count, total, squares, sn, ss, sc, wall = self.sums[op][b]
                if count < min_count or count <= 0:
                    continue
                mean = total / count
                variance = max(0.0, squares / count - mean * mean) * count / max(1.0, count - 1)
                out.append(BucketMean(op, b, int(count), sn / count, ss / count, sc / count, mean,
                                      math.sqrt(variance) / mean if mean > 0 and count > 1 else 0.0,
                                      wall / count))
        return out

    # --- the wire form ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {op: {str(b): [_wire_number(v) for v in row] for b, row in sorted(per_op.items())}
                for op, per_op in self.sums.items() if per_op}

    @classmethod
    def from_dict(cls, data: object, where: str = "forwards") -> ForwardTimes:
        if not isinstance(data, Mapping):
            raise ForwardTimesError(f"{where} must be an object, got {type(data).__name__}")
        out = cls()
        for op, per_op in data.items():
            if op not in OPS:
                raise ForwardTimesError(f"{where} has an unknown operation {str(op)[:40]!r} (known: {', '.join(OPS)})")
            if not isinstance(per_op, Mapping):
                raise ForwardTimesError(f"{where}.{op} must be an object")
            for key, row in per_op.items():
                if not (isinstance(key, str) and key.isascii() and key.isdigit() and int(key) <= MAX_BUCKET):
                    raise ForwardTimesError(f"{where}.{op} bucket {str(key)[:40]!r} must be an integer in [0, {MAX_BUCKET}]")
                if not isinstance(row, list) or len(row) != len(SUMS):
                    raise ForwardTimesError(f"{where}.{op}.{key} must be a list of {len(SUMS)} numbers ({', '.join(SUMS)})")
                for name, value in zip(SUMS, row, strict=True):
                    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= _MAX_SUM:
                        raise ForwardTimesError(f"{where}.{op}.{key}.{name} must be a number in [0, 2**53], "
                                                f"got {str(value)[:40]!r}")
                out.sums[op][int(key)] = [float(v) for v in row]
        return out


def _wire_number(value: float) -> int | float:
    rounded = round(value, _WIRE_DECIMALS)
    return int(rounded) if rounded.is_integer() else rounded


def merged(records: Iterable[ForwardTimes]) -> ForwardTimes:
    out = ForwardTimes()
    for record in records:
        out.merge(record)
    return out


def clock_for(device: torch.device) -> tuple[Callable[[], float], str]:
    """The clock a forward on ``device`` is timed with, and its name (what a record says it measured)."""
    if device.type == "cpu":
        return time.thread_time, "thread_cpu"
    return time.perf_counter, "wall"


class TimedForwards:
    """``engine.Forwards`` around the real model: each pass timed into ``times``."""

    def __init__(self, inner, times: ForwardTimes, clock: Callable[[], float]):
        self.inner = inner
        self.times = times
        self.clock = clock

    def _timed(self, op: str, n: int, s: int, c: int, call: Callable[[], object]):
        started, wall = self.clock(), time.perf_counter()
        result = call()
        ended = time.perf_counter()
        self.times.record(op, n, s, c, (self.clock() - started) * 1000, (ended - wall) * 1000, at_s=ended)
        return result

    def prefill(self, prefix: History, edit: EditTensors | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV:
        return self._timed("prefill", len(prefix), 0, 0,
                           lambda: self.inner.prefill(prefix, edit, between_layers=between_layers))

    def rank(self, prefix_kv: PrefixKV, short_term: History, candidates: torch.Tensor,
             query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        return self._timed("rank", prefix_kv.length, len(short_term), int(candidates.numel()),
                           lambda: self.inner.rank(prefix_kv, short_term, candidates, query_timestamp, edit))

    def rank_full(self, prefix: History, short_term: History, candidates: torch.Tensor,
                  query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        return self._timed("rank_full", len(prefix), len(short_term), int(candidates.numel()),
                           lambda: self.inner.rank_full(prefix, short_term, candidates, query_timestamp, edit))

    def rank_full_keeping_prefix(self, prefix: History, short_term: History, candidates: torch.Tensor,
                                 query_timestamp: int | None = None,
                                 edit: EditTensors | None = None) -> tuple[torch.Tensor, PrefixKV]:
        return self._timed("rank_full", len(prefix), len(short_term), int(candidates.numel()),
                           lambda: self.inner.rank_full_keeping_prefix(prefix, short_term, candidates,
                                                                       query_timestamp, edit))


@dataclass(frozen=True)
class ForwardTimesRecord:
    """What an instance publishes: its cumulative forward times, with what they were measured on."""

    instance: str
    ts: float  # unix seconds
    started_at: float  # the instance's run (records of one run subtract)
    device: str  # "cpu", "cuda:0", …
    model_version: str
    clock: str  # "thread_cpu" or "wall" (``clock_for``)
    times: ForwardTimes

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "instance": self.instance, "ts": self.ts, "started_at": self.started_at,
                           "device": self.device, "model_version": self.model_version, "clock": self.clock,
                           "ops": self.times.to_dict(), "drift": self.times.drift.to_dict()}, separators=(",", ":"))

    def to_entry(self) -> dict[str, bytes]:
        """The record as a stream entry: its JSON deflated, in field ``z`` (``from_entry`` reads it)."""
        deflater = zlib.compressobj(9, zlib.DEFLATED, _WBITS)
        return {"z": deflater.compress(self.to_json().encode()) + deflater.flush()}

    @classmethod
    def from_entry(cls, fields: Mapping) -> ForwardTimesRecord:
        """The one decoder of a forwards stream entry, as a client that does not decode answers reads it
        (field names and values bytes): the deflated record (``z``), or an older worker's JSON (``d``)."""
        fields = {k.decode() if isinstance(k, bytes) else k: v for k, v in fields.items()}
        if "z" in fields:
            packed = fields["z"]
            if isinstance(packed, str):
                raise ForwardTimesError("forward-times entry was read as text: read forwards streams with a client "
                                        "that does not decode answers (its bytes are deflated)")
            try:
                return cls.from_json(inflated(packed, MAX_RECORD_JSON_BYTES, wbits=_WBITS))
            except ForwardTimesError:
                raise
            except ValueError as exc:
                what = "" if str(exc).startswith("inflates past") else " is not a deflated record:"
                raise ForwardTimesError(f"forward-times entry{what} {exc}") from None
        if "d" in fields:
            return cls.from_json(fields["d"])
        raise ForwardTimesError("forward-times entry has neither field z (a deflated record) nor d (its JSON)")

    @classmethod
    def from_json(cls, raw: str | bytes) -> ForwardTimesRecord:
        """A record from its JSON (``from_entry`` reads a stream entry); ForwardTimesError names the field."""
        data = json_value(raw, "forward-times record", ForwardTimesError)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ForwardTimesError(f"forward-times record must be an object with format {FORMAT!r}")
        texts = {}
        for name in ("instance", "device", "model_version", "clock"):
            value = data.get(name)
            if not isinstance(value, str) or not 0 < len(value) <= 128:
                raise ForwardTimesError(f"forward-times record.{name} must be a text of 1..128 characters")
            texts[name] = value
        numbers = {}
        for name in ("ts", "started_at"):
            value = data.get(name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e11:
                raise ForwardTimesError(f"forward-times record.{name} must be a unix time in seconds")
            numbers[name] = float(value)
        times = ForwardTimes.from_dict(data.get("ops") or {}, "forward-times record.ops")
        times.drift = Drift.from_dict(data.get("drift"), "forward-times record.drift")  # absent: an older worker's
        return cls(times=times, **texts, **numbers)
