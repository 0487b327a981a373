"""What a measured point replays: paired windows of the trace, their events on the scaled clock, and
their routing to instances. The benchmark's real instances and the simulator's virtual ones replay
exactly these events.

**Paired windows.** A point replays ``windows`` fixed stretches of the trace on fresh instances,
each in three parts: the *primed* part, one cache TTL of the trace before it, goes through the
cache tiers' own code (``warmup.prime``: each query's prefix looked up, promoted or inserted, in
order, on the instance its router picks) without forward passes, so the tiers start in the steady
state a fleet reaches after serving that traffic; the *warm-up* part is replayed in full but not
measured (queues and lanes reach their steady state); the *measured* part counts. The stretches
depend only on the trace and the settings, never on the mode or the point, so every mode at every
point replays the very same queries: modes are compared request for request.

**Time scale K.** Every time constant of the trace is multiplied by K: arrival gaps (so the trace's
own rate is divided by K), the retrieval → ranking gap, and (in ``modes.Regime``) the SLO, the
deadline and the caches' TTLs. A device K times slower than the reference then runs the reference's
ratios of compute to time budget. A point's offered load compresses or stretches the arrivals only.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from relay_engine.core.forward_times import ForwardTimes
from relay_engine.core.router import AffinityRouter
from relay_engine.core.trace import TraceQuery

LOAD_WINDOW_S = 1.0  # × K: the router's bounded-load fallback counts the ranking requests routed in it


@dataclass(frozen=True)
class Event:
    at_s: float  # scheduled time, from the window's start
    kind: str  # "preinfer" | "rank"
    query: int  # index in the trace
    user_id: str
    seq_len: int  # the user's long-term prefix length in the trace
    cap: int  # prefixes are truncated to their most recent `cap` tokens
    short_len: int
    n_candidates: int
    measured: bool
    instance: str = ""  # where the trace says it was served ("" unknown)

    @property
    def prefix_len(self) -> int:
        return min(self.seq_len, self.cap)


@dataclass(frozen=True)
class Window:
    prime_start: int  # first query primed into the caches (no forward pass)
    start: int  # first query replayed (warm-up)
    first_measured: int
    end: int  # one past the last query

    @property
    def measured(self) -> int:
        return self.end - self.first_measured

    @property
    def primed(self) -> int:
        return self.start - self.prime_start


def paired_windows(n_queries: int, windows: int, warmup: int, measured: int, prime: int = 0) -> list[Window]:
    """``windows`` stretches of warm-up + measured queries, each after up to ``prime`` primed queries,
    spread evenly over the trace past the first ``prime`` (the same for every mode and point)."""
    span = warmup + measured
    if span > n_queries:
        raise ValueError(f"a window needs {span} queries (warm-up {warmup} + measured {measured}); "
                         f"the trace has {n_queries}")
    first = min(prime, n_queries - span)
    if windows == 1:
        starts = [n_queries - span]
    else:
        step = (n_queries - span - first) / (windows - 1)
        starts = [first + round(i * step) for i in range(windows)]
    return [Window(max(0, s - prime), s, s + warmup, s + span) for s in starts]


def primed_routes(queries: Sequence[TraceQuery], window: Window, names: Sequence[str], affinity: bool,
                  rng: random.Random, captured: Mapping[str, str] | None = None) -> dict[str, list[int]]:
    """The primed queries' indices by the instance their router picks (affinity: the rendezvous choice,
    which is where the fleet's traffic settles; random: any); ``captured``: see ``route``."""
    router = AffinityRouter(names)
    out: dict[str, list[int]] = {n: [] for n in names}
    for i in range(window.prime_start, window.start):
        q = queries[i]
        name = (captured or {}).get(q.instance) or (router.route(q.user_id) if affinity else rng.choice(names))
        out[name].append(i)
    return out


def captured_names(queries: Sequence[TraceQuery], names: Sequence[str]) -> dict[str, str] | None:
    """Each instance the trace names → one of ``names``, when the trace names as many instances as there
    are (the pool the traffic was captured on, simulated as it is); None otherwise."""
    seen = sorted({q.instance for q in queries if q.instance})
    if not seen or len(seen) != len(names):
        return None
    return dict(zip(seen, names, strict=True))


def window_rng(seed: int, window: Window) -> random.Random:
    """The random router's choices for one window: the same in every mode, point and run (paired)."""
    return random.Random(f"{seed}:{window.start}")


def trace_qps(queries: Sequence[TraceQuery]) -> float:
    span_s = (queries[-1].t_ms - queries[0].t_ms) / 1000
    return (len(queries) - 1) / span_s if span_s > 0 else 1.0


def schedule(queries: Sequence[TraceQuery], window: Window, *, cap: int, qps: float, trace_rate: float,
             time_scale: float, with_preinfer: bool) -> list[Event]:
    """The window's events on its own clock: arrivals at the offered ``qps`` (the trace's own rate is
    ``trace_rate``), each ranking request its ``rank_delay_ms`` × K after its pre-infer signal."""
    t0 = queries[window.start].t_ms
    arrival_scale = trace_rate / qps / 1000
    events = []
    for i in range(window.start, window.end):
        q = queries[i]
        at_s = (q.t_ms - t0) * arrival_scale
        common = dict(query=i, user_id=q.user_id, seq_len=q.seq_len, cap=cap, short_len=q.short_len,
                      n_candidates=q.n_candidates, measured=i >= window.first_measured, instance=q.instance)
        if with_preinfer:
            events.append(Event(at_s=at_s, kind="preinfer", **common))
        events.append(Event(at_s=at_s + q.rank_delay_ms * time_scale / 1000, kind="rank", **common))
    events.sort(key=lambda e: (e.at_s, e.kind == "rank"))
    return events


def route(events: Sequence[Event], names: Sequence[str], affinity: bool, rng: random.Random,
          time_scale: float = 1.0, *, bounded: bool = True,
          captured: Mapping[str, str] | None = None) -> dict[str, list[Event]]:
    """Affinity: the rendezvous router with its bounded-load fallback (``bounded``; off, the pure
    rendezvous choice, as the product's ``RelayClient`` routes), loads being the ranking requests
    routed to each instance in the last LOAD_WINDOW_S × K. The pre-infer signal is routed when it is
    sent and its ranking request follows it to the same instance (the cache is produced where it will
    be consumed, whatever the loads did meanwhile); a ranking request without a signal is routed when
    it arrives. Random: the signal and the ranking request each to any instance, independently.
    ``captured`` (the trace's instance names → ``names``): an event whose query names an instance of
    it goes there, as the pool's router sent it; the others are routed as above."""
    router = AffinityRouter(names)
    captured = captured or {}
    out: dict[str, list[Event]] = {n: [] for n in names}
    recent: deque[tuple[float, str]] = deque()
    loads: Counter[str] = Counter()
    signalled: dict[int, str] = {}
    window_s = LOAD_WINDOW_S * time_scale
    for ev in events:
        while recent and recent[0][0] < ev.at_s - window_s:
            loads[recent.popleft()[1]] -= 1
        if ev.instance in captured:
            name = captured[ev.instance]
        elif not affinity:
            name = rng.choice(names)
        elif ev.kind == "preinfer":
            name = signalled[ev.query] = router.route(ev.user_id, loads if bounded else None)
        else:
            name = signalled.pop(ev.query, None) or router.route(ev.user_id, loads if bounded else None)
        if ev.kind == "rank":
            recent.append((ev.at_s, name))
            loads[name] += 1
        out[name].append(ev)
    return out


@dataclass
class InstanceReport:
    """What one instance observed replaying one window."""

    ranks: list[tuple[int, float, str, bool]] = field(default_factory=list)  # (query, ms, outcome, measured)
    preinfers: list[tuple[int, bool, str | None, bool]] = field(default_factory=list)  # (query, admitted, reason, measured)
    # Where a ranking request's time went: (query, ms queued before a rank thread took it, ms of its
    # forwards alone — on a real instance the rank's thread CPU time —, ms its forwards took on the
    # shared compute — on a real instance the rank's whole wall time, waits included —, a miss's reason
    # or "").
    detail: list[tuple[int, float, float, float, str]] = field(default_factory=list)
    # The real instance's forwards in the window, timed as a pool's instances time theirs (the simulator's
    # cost model can be fitted from them, as a preview fits it from a pool's).
    forward_times: ForwardTimes | None = None
    # A real instance's ranking requests: how late its dispatcher handed each to the rank threads' queue
    # (ms after its arrival: waiting for a core and the interpreter lock; part of ``detail``'s queued).
    dispatched_late: dict[int, float] = field(default_factory=dict)
    # Where a real instance's CPU went over the window, in ms: ``window`` (wall), ``process`` (its process's
    # CPU time, every thread), ``cores_busy`` (its pinned cores busy, whoever ran on them; absent where
    # /proc cannot tell). Empty on the simulator.
    cpu_ms: dict[str, float] = field(default_factory=dict)
    # Each cache tier's peak and budget at the window's end, by tier name (every tier the engine ran).
    peak_bytes: dict[str, int] = field(default_factory=dict)
    budget_bytes: dict[str, int] = field(default_factory=dict)

    def record_tiers(self, stats) -> None:
        """Take each tier's peak and budget from an engine's ``EngineStats``."""
        self.peak_bytes = {name: figures.peak_bytes for name, figures in stats.tiers.items()}
        self.budget_bytes = {name: figures.budget_bytes for name, figures in stats.tiers.items()}
