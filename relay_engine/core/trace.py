"""The trace format: ranking traffic as JSON Lines, one query per line.

A trace line is one query: ``t_ms`` (arrival of the pre-infer signal, ms from trace start),
``user_id``, ``seq_len`` (long-term prefix tokens), ``short_len``, ``n_candidates`` and
``rank_delay_ms`` (pre-infer signal → ranking request); optionally ``instance``, the instance that
served it (a trace exported from captured traffic has it: a preview sends each request where the
pool's router sent it). Unknown fields are ignored; a malformed
line is an error naming its line number. A trace carries no token ids: ``features.SyntheticFeatures``
derives them. The traffic replayer, the benchmark and the simulator all read traces through here;
generating one is the lab's (``relay_engine.lab.traffic``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from relay_engine.core import fields

FIELDS = ("t_ms", "user_id", "seq_len", "short_len", "n_candidates", "rank_delay_ms")
MAX_TRACE_SEQ_LEN = 1 << 20
MAX_CANDIDATES = 100_000


class TraceError(ValueError):
    def __init__(self, line_no: int, message: str, source: str = "trace"):
        self.line_no = line_no
        super().__init__(f"{source}, line {line_no}: {message}")


@dataclass(frozen=True)
class TraceQuery:
    t_ms: float
    user_id: str
    seq_len: int
    short_len: int
    n_candidates: int
    rank_delay_ms: float
    instance: str = ""  # the instance that served it, where the trace was captured ("" unknown)

    def to_json(self) -> str:
        data = asdict(self)
        if not self.instance:
            del data["instance"]
        return json.dumps(data, separators=(",", ":"))


def _field_number(data: dict, key: str, *, integer: bool, lo: float, hi: float) -> float | int:
    if key not in data:
        raise ValueError(f"missing field {key!r}")
    try:
        return fields.integer(data[key], int(lo), int(hi)) if integer else fields.number(data[key], lo, hi)
    except fields.FieldValueError as exc:
        raise ValueError(f"field {key!r} {exc}") from None


def parse_query(line: str) -> TraceQuery:
    """One trace line → TraceQuery; ValueError naming the field when it is malformed."""
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:  # a line of thousands of nested brackets: no query, and no crash either
        raise ValueError("not a trace query: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, got {type(data).__name__}")
    user = data.get("user_id")
    if isinstance(user, bool) or not isinstance(user, (str, int)) or str(user) == "":
        raise ValueError(f"field 'user_id' must be a non-empty string, got {user!r}")
    if len(str(user)) > 256:
        raise ValueError("field 'user_id' is longer than 256 characters")
    instance = data.get("instance", "")
    if not isinstance(instance, str) or len(instance) > 256 or not instance.isprintable():
        raise ValueError(f"field 'instance' must be an instance name (at most 256 printable characters), "
                         f"got {str(instance)[:40]!r}")
    return TraceQuery(
        t_ms=float(_field_number(data, "t_ms", integer=False, lo=0, hi=1e12)),
        user_id=str(user),
        seq_len=int(_field_number(data, "seq_len", integer=True, lo=1, hi=MAX_TRACE_SEQ_LEN)),
        short_len=int(_field_number(data, "short_len", integer=True, lo=0, hi=MAX_TRACE_SEQ_LEN)),
        n_candidates=int(_field_number(data, "n_candidates", integer=True, lo=1, hi=MAX_CANDIDATES)),
        rank_delay_ms=float(_field_number(data, "rank_delay_ms", integer=False, lo=0, hi=3.6e6)),
        instance=instance,
    )


def iter_trace(lines: Iterable[str], source: str = "trace") -> Iterator[TraceQuery]:
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield parse_query(line)
        except ValueError as exc:
            raise TraceError(line_no, str(exc), source) from None


def read_trace(path: str | Path) -> list[TraceQuery]:
    """All queries of a trace file, sorted by arrival; TraceError names the bad line."""
    path = Path(path)
    lines = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                lines.append(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise TraceError(line_no, f"not UTF-8 text (byte {exc.start + 1} of the line)", str(path)) from None
    queries = list(iter_trace(lines, str(path)))
    queries.sort(key=lambda q: q.t_ms)
    return queries


def write_trace(path: str | Path, queries: Iterable[TraceQuery]) -> int:
    n = 0
    with Path(path).open("w", encoding="utf-8") as f:
        for q in queries:
            f.write(q.to_json() + "\n")
            n += 1
    return n
