"""Traffic capture: the shape of one ranking request, as the fleet records it and as a trace replays it.

An instance records, per ranking request, a ``CaptureRecord``: when it arrived (unix ms), a keyed
hash of the user (never the raw id), prefix and short-term lengths, candidates, the retrieval→ranking
gap when the instance saw that user's pre-infer signal, the outcome (the cache tier that served it,
or the error kind), the latency and the instance that served it; and, where the instance measured
them, the rank's own CPU time (its forwards, against the latency's waits) and how long the signal
took from its sender to the trigger's decision (absent in older records). Records go to one bounded stream per pool (``PoolKeys.traffic``:
``XADD … MAXLEN ~ CAPTURE_MAX_RECORDS``, ``XTRIM MINID`` for ``CAPTURE_MAX_AGE_S``).

The hash is an HMAC of the user id under the pool's capture key, itself an HMAC of the pool name
under the deployment's capture secret (``capture_key``). The secret lives in the workers' environment,
never in Redis, so whoever reads Redis (the hashes included) cannot try the id space against them;
every instance of a pool derives the same key, so one user hashes alike everywhere and repeats stay
visible; pools hash apart.

``to_trace`` turns records into the trace format (``trace.TraceQuery``): a query's ``t_ms`` is the
pre-infer signal's time at the instance — when the trigger decided on it: ranking time − gap + the
signal's delay where recorded (a prefill can start no earlier), else ranking time − gap —, from the
first signal of the window; a request whose gap is unknown gets the window's median known gap
(``DEFAULT_GAP_MS`` when none is known).
Redis is untrusted input: ``CaptureRecord.from_fields`` checks every field and raises
``CaptureError`` naming it.
"""

from __future__ import annotations

import hashlib
import hmac
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from relay_engine.core import fields
from relay_engine.core.outcomes import Outcome
from relay_engine.core.telemetry import MISS_REASONS
from relay_engine.core.trace import MAX_CANDIDATES, MAX_TRACE_SEQ_LEN, TraceQuery

CAPTURE_MAX_RECORDS = 100_000  # per pool, approximate (MAXLEN ~)
CAPTURE_MAX_AGE_S = 3600.0  # records older than this are trimmed (MINID)
DEFAULT_GAP_MS = 40.0  # retrieval→ranking gap assumed when a window has no known gap at all
USER_HASH_HEX = 16  # 64 bits of sha256: repeats of one user stay apart from other users' in any window

# What served a request (an ``Outcome``: ``engine.RankResult.source``) or why it failed.
SERVED_OUTCOMES: tuple[str, ...] = tuple(Outcome)
ERROR_OUTCOMES = ("deadline_exceeded", "invalid_input", "internal")
OUTCOMES = SERVED_OUTCOMES + ERROR_OUTCOMES

_MAX_UNIX_MS = 1e14
MAX_INSTANCE_CHARS = 200


class CaptureError(ValueError):
    """A capture record read from Redis that breaks the contract; the message names the field."""


def capture_key(secret: str, pool: str) -> bytes:
    """The pool's key of the user-id hash, derived from the deployment's capture secret."""
    return hmac.new(secret.encode(), f"relaygr capture key\x00{pool}".encode(), hashlib.sha256).digest()


def user_hash(key: bytes, user_id: str) -> str:
    """The keyed hash of a user id under the pool's ``capture_key`` (what the capture stores instead of the id)."""
    return hmac.new(key, user_id.encode(), hashlib.sha256).hexdigest()[:USER_HASH_HEX]


@dataclass(frozen=True)
class CaptureRecord:
    ts_ms: float  # the ranking request's arrival at the instance, unix ms
    user: str  # user_hash(capture_key(secret, pool), user id)
    prefix_len: int
    short_len: int
    candidates: int
    gap_ms: float | None  # pre-infer signal → ranking request, when the instance saw the signal
    outcome: str  # one of OUTCOMES
    latency_ms: float
    miss_reason: str = ""  # a miss's ``MissReason``; "" for other outcomes and records older than it
    instance: str = ""  # the instance that served it (stream field ``i``); empty in records older than the field
    cpu_ms: float | None = None  # the rank's own CPU time (field ``k``): the latency less its waits, on a CPU
    signal_delay_ms: float | None = None  # its signal's sender → the trigger's decision (field ``d``)

    def to_fields(self) -> dict[str, str]:
        """Stream entry fields (short names: a stream of 100k entries stores them once per node)."""
        return {"t": f"{self.ts_ms:.3f}", "u": self.user, "p": str(self.prefix_len), "s": str(self.short_len),
                "c": str(self.candidates), "g": "" if self.gap_ms is None else f"{self.gap_ms:.3f}",
                "o": self.outcome, "l": f"{self.latency_ms:.3f}", **({"r": self.miss_reason} if self.miss_reason else {}),
                **({"i": self.instance} if self.instance else {}),
                **({"k": f"{self.cpu_ms:.3f}"} if self.cpu_ms is not None else {}),
                **({"d": f"{self.signal_delay_ms:.3f}"} if self.signal_delay_ms is not None else {})}

    @classmethod
    def from_fields(cls, data: Mapping[str, str]) -> CaptureRecord:
        def get(name: str, what: str) -> str:
            value = data.get(name)
            if not isinstance(value, str):
                raise CaptureError(f"capture record.{what} is missing")
            return value

        def num(name: str, what: str, lo: float, hi: float, *, integer: bool = False) -> float | int:
            text = get(name, what)
            try:
                return fields.number_text(text, lo, hi, as_int=integer)
            except fields.FieldValueError as exc:
                raise CaptureError(f"capture record.{what} {exc}") from None

        user = get("u", "user")
        if not user or len(user) > 64 or not user.isalnum():
            raise CaptureError(f"capture record.user must be a hash (1..64 letters or digits), got {user[:40]!r}")
        outcome = get("o", "outcome")
        if outcome not in OUTCOMES:
            raise CaptureError(f"capture record.outcome must be one of {', '.join(OUTCOMES)}, got {outcome[:40]!r}")
        gap = get("g", "gap_ms")
        miss_reason = data.get("r", "")
        if miss_reason and miss_reason not in MISS_REASONS:
            raise CaptureError(f"capture record.miss_reason must be empty or one of {', '.join(MISS_REASONS)}, "
                               f"got {str(miss_reason)[:40]!r}")
        instance = data.get("i", "")
        if not isinstance(instance, str) or len(instance) > MAX_INSTANCE_CHARS or not instance.isprintable():
            raise CaptureError(f"capture record.instance must be an instance name (at most {MAX_INSTANCE_CHARS} "
                               f"printable characters), got {str(instance)[:40]!r}")
        return cls(
            ts_ms=float(num("t", "ts_ms", 0, _MAX_UNIX_MS)), user=user,
            prefix_len=int(num("p", "prefix_len", 0, MAX_TRACE_SEQ_LEN, integer=True)),
            short_len=int(num("s", "short_len", 0, MAX_TRACE_SEQ_LEN, integer=True)),
            candidates=int(num("c", "candidates", 0, MAX_CANDIDATES, integer=True)),
            gap_ms=None if gap == "" else float(num("g", "gap_ms", 0, 3.6e6)),
            outcome=outcome, latency_ms=float(num("l", "latency_ms", 0, 3.6e6)), miss_reason=miss_reason,
            instance=instance,
            cpu_ms=float(num("k", "cpu_ms", 0, 3.6e6)) if "k" in data else None,
            signal_delay_ms=float(num("d", "signal_delay_ms", 0, 3.6e6)) if "d" in data else None,
        )


def replayable(record: CaptureRecord) -> bool:
    """A record a trace can hold: a prefix and at least one candidate (a malformed request has neither)."""
    return record.prefix_len >= 1 and record.candidates >= 1


def window_gap_ms(records: Iterable[CaptureRecord]) -> float:
    """The gap to assume for a request whose gap is unknown: the median known one of the window."""
    known = [r.gap_ms for r in records if r.gap_ms is not None]
    return statistics.median(known) if known else DEFAULT_GAP_MS


def trace_order(records: Iterable[CaptureRecord]) -> list[tuple[float, CaptureRecord]]:
    """The records a trace can hold, each with its pre-infer signal's unix ms, sorted by it: the order
    of ``to_trace``'s queries (its i-th query is the i-th record here)."""
    kept = [r for r in records if replayable(r)]
    fallback = window_gap_ms(kept) if kept else DEFAULT_GAP_MS
    return sorted(((r.ts_ms - (fallback if r.gap_ms is None else r.gap_ms - min(r.gap_ms, r.signal_delay_ms or 0.0)),
                    r) for r in kept), key=lambda pair: pair[0])


def to_trace(records: Iterable[CaptureRecord]) -> list[TraceQuery]:
    """Captured ranking requests → trace queries (sorted by pre-infer signal time, ``t_ms`` from the
    first). Requests no trace can hold (``replayable``) are left out."""
    signals = trace_order(records)
    if not signals:
        return []
    start = signals[0][0]
    return [TraceQuery(t_ms=round(t - start, 3), user_id=r.user, seq_len=r.prefix_len, short_len=r.short_len,
                       n_candidates=r.candidates, rank_delay_ms=round(r.ts_ms - t, 3), instance=r.instance)
            for t, r in signals]
