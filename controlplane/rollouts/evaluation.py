"""The bake's decision rule: pure arithmetic over counts (no I/O), so it reads as the rule it is.

A request is *bad* when it failed, missed its deadline or took longer than the SLO. Both sides are
judged on one yardstick, the stable revision's SLO: a canary that changes the SLO is refused at
start (``services._same_yardstick``), since each instance counts against its own revision's SLO. The
ranking SLO is a P99, so the error budget is 1 % of requests and the *burn* is the bad share
divided by it (burn 1.0: spending the budget exactly as fast as it is earned). Shares carry a 95 %
Wilson score interval, and the canary's excess over stable a 95 % interval of the difference of
the two shares (Newcombe's hybrid score interval, from the two Wilson intervals).

- **Roll back at once** when a canary instance NACKs the generation; or when the canary has at least
  ``min_requests`` requests and the *lower* Wilson bound of its bad share, as a burn, exceeds
  ``max_burn`` — unless stable burns past ``max_burn`` too (the pool itself is over budget: then the
  canary is rolled back early only when it is worse than stable, the difference's lower bound above 0).
- **At bake end** roll back when a canary instance is not live or does not run the generation, when
  the canary served fewer than ``min_requests`` (too little evidence to promote), or when it is
  materially worse than stable (the difference's lower bound above 0). Then, when the canary's burn
  exceeds ``max_burn``: roll back if stable is within it; if both sides burn, promote and say so
  (the canary is not worse than what every other instance already serves). Otherwise **promote**.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

P99_ERROR_BUDGET = 1 - 0.99
WILSON_Z = 1.96  # 95 %
DEFAULT_MIN_REQUESTS = 50


def wilson_interval(bad: int, requests: int, z: float = WILSON_Z) -> tuple[float, float]:
    """The Wilson score interval of the share ``bad / requests`` ((0, 1) with no requests)."""
    if requests <= 0:
        return 0.0, 1.0
    share = bad / requests
    denominator = 1 + z * z / requests
    centre = share + z * z / (2 * requests)
    spread = z * math.sqrt(share * (1 - share) / requests + z * z / (4 * requests * requests))
    return max(0.0, (centre - spread) / denominator), min(1.0, (centre + spread) / denominator)


@dataclass(frozen=True)
class GroupFigures:
    """One side of the comparison (the canary instances, or the stable ones) over the bake so far."""

    requests: int
    bad: int
    bad_share: float | None
    burn: float | None
    bad_low: float  # Wilson bounds of the bad share
    bad_high: float
    burn_low: float  # the same bounds as burns
    burn_high: float
    p99_ms: float | None = None

    @classmethod
    def of(cls, requests: int, bad: int, p99_ms: float | None = None) -> GroupFigures:
        requests, bad = max(0, int(requests)), max(0, min(int(bad), int(requests)))
        low, high = wilson_interval(bad, requests)
        share = bad / requests if requests else None
        return cls(requests=requests, bad=bad, bad_share=_rounded(share),
                   burn=None if share is None else _rounded(share / P99_ERROR_BUDGET),
                   bad_low=_rounded(low), bad_high=_rounded(high), burn_low=_rounded(low / P99_ERROR_BUDGET),
                   burn_high=_rounded(high / P99_ERROR_BUDGET), p99_ms=_rounded(p99_ms))

    def to_dict(self) -> dict:
        return asdict(self)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)


def difference_interval(canary: GroupFigures, stable: GroupFigures) -> tuple[float, float] | None:
    """95 % interval of canary's bad share − stable's (Newcombe 1998, method 10); None without requests."""
    if not canary.requests or not stable.requests:
        return None
    p1, p2 = canary.bad / canary.requests, stable.bad / stable.requests
    d = p1 - p2
    low = d - math.sqrt((p1 - canary.bad_low) ** 2 + (stable.bad_high - p2) ** 2)
    high = d + math.sqrt((canary.bad_high - p1) ** 2 + (p2 - stable.bad_low) ** 2)
    return max(-1.0, low), min(1.0, high)


def _points(interval: tuple[float, float]) -> str:
    return f"[{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}] points"


@dataclass(frozen=True)
class Decision:
    action: str  # "bake" (keep baking), "promote" or "rollback"
    reason: str


def decide(*, canary: GroupFigures, stable: GroupFigures, max_burn: float, bake_over: bool, min_requests: int,
           nacked: dict[str, str], not_live: list[str], not_running: list[str], yardstick: str = "") -> Decision:
    """The rule of the module's docstring. ``nacked``: canary instance → its error; ``not_live`` and
    ``not_running``: canary instances without a live heartbeat / not reporting ACK of the generation;
    ``yardstick``: the SLO both sides were judged on, in words, for the reason."""
    on = f" (judged on {yardstick})" if yardstick else ""
    if nacked:
        name, error = sorted(nacked.items())[0]
        return Decision("rollback", f"canary instance {name} refused the generation (NACK): {error}")
    diff = difference_interval(canary, stable)
    worse = diff is not None and diff[0] > 0 and canary.requests >= min_requests
    stable_burns = stable.requests >= min_requests and stable.burn_low > max_burn
    counts = f"{canary.bad} bad of {canary.requests} requests against stable's {stable.bad} of {stable.requests}"
    if canary.requests >= min_requests and canary.burn_low > max_burn:
        if not stable_burns:
            return Decision("rollback", f"canary burn {canary.burn:.2f} exceeds max_burn {max_burn:g} (lower 95% "
                                        f"bound {canary.burn_low:.2f}; {canary.bad} bad of {canary.requests} "
                                        f"requests) while stable burns {_burn(stable)}{on}")
        if worse:
            return Decision("rollback", f"both sides burn past max_burn {max_burn:g} and the canary is worse: its "
                                        f"bad share exceeds stable's by {_points(diff)} ({counts}){on}")
    if not bake_over:
        return Decision("bake", "baking")
    if not_live:
        return Decision("rollback", f"canary instance {', '.join(not_live)} is not live at bake end: not promoted")
    if not_running:
        return Decision("rollback", f"canary instance {', '.join(not_running)} does not run the generation at "
                                    "bake end: not promoted")
    if canary.requests < min_requests:
        return Decision("rollback", f"the canary served {canary.requests} requests, fewer than the "
                                    f"{min_requests} needed to judge it: not promoted")
    if worse:
        return Decision("rollback", f"canary is materially worse than stable: its bad share exceeds stable's by "
                                    f"{_points(diff)} ({counts}){on}")
    if canary.burn > max_burn:
        if stable.burn is not None and stable.burn > max_burn:
            return Decision("promote", f"both sides burn past max_burn {max_burn:g} (canary {canary.burn:.2f}, "
                                       f"stable {stable.burn:.2f}); the canary is not worse than stable (difference "
                                       f"{_points(diff)}, {counts}){on}")
        return Decision("rollback", f"canary burn {canary.burn:.2f} exceeds max_burn {max_burn:g} at bake end "
                                    f"while stable burns {_burn(stable)} ({counts}){on}")
    versus = f"difference {_points(diff)}" if diff is not None else "no stable requests to compare with"
    return Decision("promote", f"canary burn {canary.burn:.2f} within max_burn {max_burn:g} ({canary.bad} bad of "
                               f"{canary.requests} requests), not worse than stable (stable burn "
                               f"{_burn(stable)}, {versus}){on}")


def _burn(figures: GroupFigures) -> str:
    return "nothing (no requests)" if figures.burn is None else f"{figures.burn:.2f}"
