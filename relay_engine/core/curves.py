"""Miss-ratio curves: the hit ratio a pool would have had, from its captured traffic, as a function of the
HBM budget per instance, of each lower tier's budget (``outcomes.TIERS``: DRAM, disk) and of the entry TTL.

The model (what the tier stack does, ``tiers.TierStack``, ``kvcache.HBMCache``, ``dram.DRAMTier``):

* **Key**: a cache entry is (instance, user hash, prefix length). The engine's key is (user, prefix
  digest, model version, edit hash); the capture has neither digest nor edit, so one user with one
  prefix length is taken for one prefix (the trace format's own rule: the replayer derives a prefix
  from (user, length)), and the model and the edit are taken as constant over the window.
* **Size**: an entry holds ``prefix_nbytes`` bytes for its length (the model's own formula, repeated
  here in stdlib for the control plane, which does not load torch; a test checks it against the model).
* **Hierarchy**: exclusive, one LRU order. HBM evicts its least recently used entry for space and
  demotes it to DRAM; DRAM evicts its least recently *stored*, which is the least recently used, and
  demotes to the tier below; a hit in a lower tier takes the entry out and promotes it back to HBM;
  a miss recomputes and keeps the prefix in HBM. So all tiers together are one LRU stack, split at
  the budgets: a request whose byte-weighted reuse distance (the bytes of the distinct entries used
  since its entry's last use, its own included) is d is an HBM hit if d ≤ HBM budget, a hit of the
  first lower tier if d ≤ HBM + that tier's budget, and so on.
* **TTL**: HBM's ``entry_ttl_ms`` runs from the entry's insertion into HBM (a recompute, a
  pre-inference, a promotion), not from its last hit: a hot entry still expires and is recomputed,
  which restarts its clock (computed exactly, per key, as chains of restarts). An expired entry is
  dropped, not demoted. A lower tier's TTL runs from the entry's demotion into it; the model measures
  it from the entry's last use, which is never later (so it can only over-predict lower-tier expiry).
* **Pre-inference**: a request marked ``preinferred`` (its pre-infer signal was seen and its prefix is
  at risk, so the trigger would admit it) finds its prefix in HBM whatever the history, as long as the
  prefix fits the HBM budget; when some tier already held it, the trigger refuses (already cached)
  and the request is served from that tier as any other. Either way its use is one access. A miss the
  live trigger refused for a reason that does not depend on the cache (``PREINFER_LOST``: its load
  limits, not at risk, pre-inference off) or whose computation came too late is not pre-inferred at
  any budget: the capture's miss reason says so.
* **Router**: each instance has its own stack; the requests carry the instance that served them.

Known deviations (why the curve is an estimate, not a replay):

* Entry boundaries: a tier's bytes are a whole number of entries, so a tier may hold up to one entry
  less than its budget says (exact when entries are one size and budgets a multiple of it).
* An entry larger than the HBM budget is never admitted, so it does not push others out; the model
  still counts its bytes in others' distances (rare: a prefix is MiB, a budget GiB).
* Expired entries are counted in others' distances until they are reused or pushed out, while the
  engine's sweep frees their bytes earlier: with a TTL shorter than typical reuse, the model
  under-predicts hits.
* The trigger's load limits are taken from the window as it was served, not replayed: a request they
  refused is refused at every budget, though another budget would have changed the load a little;
  the cache budget share's refusals (``RefusalReason.CACHE_BUDGET``) depend on the budget and count as
  admitted. A request that hit while a limit would have refused it leaves no trace in the capture
  (only misses carry a reason): it counts as admitted.
* Unread pre-inferred entries are evicted after read ones (``kvcache.LRUPolicy``); the model is plain
  LRU (the difference lasts the tens of milliseconds between a signal and its rank).
* Concurrent requests of one key (joins of a computation in flight) are hits at distance = own size.

The algorithm: per-request reuse distance in bytes and age since the last use are computed once
(O(n log² n), vectorised: a reuse pair's distance is the bytes used since its last use minus those of
the reuse pairs nested inside it, a 2-D dominance sum answered level by level of a binary split of
positions); each budget/TTL point is then vectorised counting, plus the TTL restart chains (pointer
doubling, O(n log n) per HBM budget or TTL). Windows of more than ``EXACT_REQUESTS`` are sampled
(``sampling_plan``): the most requested entries are kept whole, as many as the skew asks (until the first
one sampled would weigh at most 0.1 % of the window; at most 3/4 of the requests kept), the others
spatially sampled (SHARDS: entries whose hash falls under rate R, each standing for 1 / R entries in
others' distances and in the counts, its own size counted once in its own), and shares are of the
weighted count. Plain SHARDS at one rate missed by 1 to 6 points at every budget on Zipf-like traffic,
where a few entries hold a percent of the requests each: one of them in or out of the sample moved the
whole curve. The answer says the rate and how many entries were kept whole.

Stdlib and numpy only: the control plane computes curves without loading torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from relay_engine.core.outcomes import TIERS, Outcome
from relay_engine.core.telemetry import NOT_ADMITTED, MissReason, RefusalReason

# Requests computed exactly; a larger window is sampled down to about this many (``sampling_plan``).
EXACT_REQUESTS = 1_000_000
CURVE_POINTS = 24  # budget or TTL values per axis (plus the live value)
# Sampling (``sampling_plan``): the most requested entries are kept whole until the first one sampled
# would weigh at most this share of the window, and take at most this share of the kept requests.
_SAMPLED_SHARE_MAX = 0.001
_WHOLE_SHARE_MAX = 0.75
_HASH_BITS = 24
_HASH_SPACE = 2**_HASH_BITS
# The misses whose pre-inference the live pool lost for reasons that do not depend on the cache's budgets
# or contents: the trigger's refusals but the cache budget share's, and a computation that would
# have finished past the deadline. Such a request is not pre-inferred at any point of a curve.
PREINFER_LOST: frozenset[str] = frozenset({
    *(reason for refusal, reason in NOT_ADMITTED.items() if refusal is not RefusalReason.CACHE_BUDGET),
    MissReason.TOO_LATE})


def prefix_nbytes(seq_len: int, *, num_layers: int, num_heads: int, head_dim: int,
                  with_timestamps: bool = False, carries_tail: bool = False) -> int:
    """Bytes of the PrefixKV of ``seq_len`` tokens, as ``HSTUModel.prefix_nbytes`` counts them: K and V
    (float32) per layer and head, a timestamp per token when the model reads them, the tail token's ids."""
    per_token = num_layers * 2 * num_heads * head_dim * 4 + (8 if with_timestamps else 0)
    tail = 1 if carries_tail else 0
    return (seq_len - tail) * per_token + tail * 8 * (3 if with_timestamps else 2)


@dataclass(frozen=True)
class Requests:
    """The ranking requests of a window, one element per request (any order).

    ``key``: the cache entry (any integers; equal for one (user, prefix length) on one instance);
    ``instance``: which stack served it; ``preinferred``: the trigger would have pre-inferred it."""

    ts_ms: np.ndarray  # float64, arrival
    key: np.ndarray  # int64
    nbytes: np.ndarray  # int64, the entry's size
    instance: np.ndarray  # int64
    preinferred: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.ts_ms)


@dataclass(frozen=True)
class TierBudget:
    """One tier's budget and TTL, in the units of the policy's cache section, converted."""

    name: Outcome
    budget_bytes: float
    ttl_ms: float


@dataclass(frozen=True)
class Split:
    """Predicted shares of requests: served from each tier (``by_tier``, in lookup order) and in all."""

    hit_ratio: float
    by_tier: dict[str, float]


def sampling_plan(requests_per_entry: np.ndarray, limit: int = EXACT_REQUESTS) -> tuple[np.ndarray, float]:
    """Which entries are kept whole, and the SHARDS rate for the others, to keep about ``limit`` requests.

    Under a skewed popularity one hot entry in or out of a plain sample moves every point by points: its
    c requests count c / rate or nothing, and its bytes 1 / rate times or not at all in the distances of
    all the requests around its uses. So the most requested entries are kept whole, as many as it takes
    for the first one sampled to weigh at most ``_SAMPLED_SHARE_MAX`` of the window (c / rate, with the
    rate that fills the rest of the limit), and no more than ``_WHOLE_SHARE_MAX`` of the limit: none
    under a flat popularity, more the more skewed. Under ``limit`` requests: every entry whole, rate 1."""
    total = int(requests_per_entry.sum())
    if total <= limit:
        return np.ones(len(requests_per_entry), dtype=bool), 1.0
    by_count = np.argsort(-requests_per_entry, kind="stable")
    counts = requests_per_entry[by_count].astype(np.float64)
    whole_requests = np.concatenate(([0.0], np.cumsum(counts)))[:-1]  # [k]: of the k most requested
    affordable = np.flatnonzero(whole_requests <= _WHOLE_SHARE_MAX * limit)  # k = 0 always
    rates = (limit - whole_requests[affordable]) / (total - whole_requests[affordable])
    light = np.flatnonzero(counts[affordable] / rates <= _SAMPLED_SHARE_MAX * total)
    k = int(light[0]) if len(light) else int(affordable[-1])
    whole = np.zeros(len(requests_per_entry), dtype=bool)
    whole[by_count[:k]] = True
    return whole, float(rates[k])


def _key_hash(key: np.ndarray) -> np.ndarray:
    """A per-key pseudo-random number in [0, _HASH_SPACE): SplitMix64 of the key id. (A bare multiplicative
    hash sends id 0, the first key after ``np.unique``, to 0, so that key was in every sample.)"""
    with np.errstate(over="ignore"):
        z = key.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        return (z >> np.uint64(64 - _HASH_BITS)).astype(np.int64)


@dataclass
class Profile:
    """What every point is counted from: per request, in (key, time) order, the byte-weighted reuse
    distance (inf on first use), the age since the last use (inf on first use), the entry's size."""

    rate: float  # SHARDS sampling rate of the entries not kept whole (1.0: every request)
    requests_total: int  # in the window
    entries_whole: int  # the most requested entries, kept with every request whatever the rate
    weight: np.ndarray  # requests of the window each stands for: 1 (kept whole), 1 / rate (sampled)
    distance_bytes: np.ndarray
    age_ms: np.ndarray
    nbytes: np.ndarray
    preinferred: np.ndarray
    first: np.ndarray  # first use of its key in the window
    _chain_time: np.ndarray = field(repr=False)  # key rank × stride + time: one monotonic axis for all keys
    _span_ms: float = field(repr=False)
    working_set_bytes: float = 0.0  # the largest instance's distinct bytes (weighted back)
    # The last HBM hits asked, by (budget, TTL): every point of a lower tier's axis asks the same.
    _hbm_hits: tuple[tuple[float, float], np.ndarray] | None = field(default=None, repr=False)

    @property
    def requests_used(self) -> int:
        return len(self.distance_bytes)

    def split(self, hbm_bytes: float, entry_ttl_ms: float, lower: Sequence[TierBudget] = ()) -> Split:
        """The predicted outcome shares under these budgets (bytes per instance) and TTLs."""
        if self.requests_used == 0:
            return Split(0.0, {str(t): 0.0 for t in (Outcome.HBM, *(t.name for t in lower))})
        # Distances are in the window's bytes (sampled entries weighted by 1 / rate), so budgets are too.
        hbm_hit = self._hbm_hit(hbm_bytes, entry_ttl_ms)
        decided = hbm_hit.copy()
        counts = {str(Outcome.HBM): 0.0}
        edge = hbm_bytes
        fits_hbm = self.nbytes <= hbm_bytes
        for tier in lower:
            top, edge = edge, edge + tier.budget_bytes
            hit = (~decided & (self.distance_bytes > top) & (self.distance_bytes <= edge)
                   & (self.age_ms <= tier.ttl_ms) & fits_hbm & (self.nbytes <= tier.budget_bytes))
            counts[str(tier.name)] = float(self.weight[hit].sum())
            decided |= hit
        hbm = float(self.weight[hbm_hit | (~decided & self.preinferred & fits_hbm)].sum())
        # Shares of the sample's weighted count, not of the window's: with the hot entries kept whole the
        # ratio is the steadier estimate (SHARDS-adj, which puts the count's difference on HBM hits, was
        # measured up to 2 points off at every budget, where this stays within 0.3).
        n = float(self.weight.sum())
        counts[str(Outcome.HBM)] = hbm
        by_tier = {name: min(1.0, c / n) for name, c in counts.items()}
        return Split(sum(by_tier.values()), by_tier)

    def _hbm_hit(self, hbm_bytes: float, ttl_ms: float) -> np.ndarray:
        """The requests HBM serves at this budget and TTL (resident by distance, not expired); the last
        answer is kept, as a lower tier's axis asks the same HBM again for every point."""
        if self._hbm_hits is None or self._hbm_hits[0] != (hbm_bytes, ttl_ms):
            eligible = self.distance_bytes <= hbm_bytes
            self._hbm_hits = ((hbm_bytes, ttl_ms), eligible & ~self._expiries(eligible, ttl_ms))
        return self._hbm_hits[1]

    def _expiries(self, eligible: np.ndarray, ttl_ms: float) -> np.ndarray:
        """The eligible requests (their entry would be resident by distance) that find it expired: per
        key, its clock starts at each insertion (every request not served from HBM), and the first
        request past ``ttl_ms`` from it is recomputed, which starts it again."""
        n = len(eligible)
        restart = ~eligible  # always an insertion (first uses included: every key starts with one)
        index = np.arange(n)
        last_restart = np.maximum.accumulate(np.where(restart, index, 0))
        since = self._chain_time - self._chain_time[last_restart]
        if ttl_ms >= self._span_ms or not (eligible & (since > ttl_ms)).any():
            return np.zeros(n, dtype=bool)
        # next_restart[k]: the next forced insertion after k (n: none); jump[k]: the first request of
        # k's key past the TTL from k, or that forced insertion if it comes first.
        forced_at = np.where(restart, index, n)
        next_restart = np.minimum.accumulate(forced_at[::-1])[::-1]
        next_restart = np.append(next_restart[1:], n)
        jump = np.searchsorted(self._chain_time, self._chain_time + ttl_ms, side="right")
        jump = np.minimum(jump, next_restart)
        # Every insertion is reachable from a forced one by jumps: mark the closure by pointer doubling.
        longest = int(min(n, math.ceil(self._span_ms / max(ttl_ms, 1e-9)) + 2))
        levels = max(1, longest.bit_length())
        tables = [np.append(jump, n).astype(np.int64)]
        for _ in range(levels - 1):
            tables.append(tables[-1][tables[-1]])
        marked = np.append(restart, False)
        for table in reversed(tables):
            marked[table[np.flatnonzero(marked)]] = True
        return marked[:n] & eligible


def _reuse_distances(key: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(previous use index or −1, byte-weighted reuse distance or inf) for requests in time order.

    For a reuse pair (j, i) of one key: the bytes of the requests in (j, i), minus those of the
    requests in it whose key is used again before i (the pairs (a, b) with j < a, b < i), plus its own."""
    n = len(key)
    order = np.lexsort((np.arange(n), key))
    same = key[order][1:] == key[order][:-1]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    sizes = nbytes.astype(np.int64)
    cum = np.concatenate(([0], np.cumsum(sizes)))
    q = np.flatnonzero(prev >= 0)  # queries and points alike: the reuse pairs (prev[q], q)
    j = prev[q]
    distance = np.full(n, np.inf)
    if len(q) == 0:
        return prev, distance
    nested = np.zeros(len(q), dtype=np.int64)
    by_a = np.argsort(j, kind="stable")
    a_sorted, b_sorted, w_sorted = j[by_a], q[by_a], sizes[j[by_a]]
    stride = np.int64(n + 1)
    for level in range(int(n).bit_length()):
        # b < i exactly when, at the highest bit where they differ (this level), b has 0 and i has 1.
        points = ((b_sorted >> level) & 1) == 0
        queries = ((q >> level) & 1) == 1
        if not points.any() or not queries.any():
            continue
        group = b_sorted[points] >> (level + 1)
        by_group = np.argsort(group, kind="stable")  # stable: a stays sorted within a group
        composite = group[by_group] * stride + a_sorted[points][by_group]
        weights = np.concatenate(([0], np.cumsum(w_sorted[points][by_group])))
        qgroup = q[queries] >> (level + 1)
        end = np.searchsorted(composite, qgroup * stride + n, side="right")
        after_j = np.searchsorted(composite, qgroup * stride + j[queries], side="right")
        nested[queries] += weights[end] - weights[after_j]
    distance[q] = (cum[q] - cum[j + 1] - nested + sizes[q]).astype(np.float64)
    return prev, distance


def profile(requests: Requests, *, limit: int = EXACT_REQUESTS) -> Profile:
    """Per-request distances and ages of ``requests``, from about ``limit`` of them (``sampling_plan``)."""
    total = len(requests)
    if limit < 1:
        raise ValueError(f"limit must be a positive number of requests, got {limit}")
    # One cache entry per (instance, key): each instance has its own stack.
    key = requests.key.astype(np.int64)
    _, key = np.unique(key, return_inverse=True)
    entry = requests.instance.astype(np.int64) * (int(key.max(initial=0)) + 1) + key.ravel()
    _, entry, requests_per_entry = np.unique(entry, return_inverse=True, return_counts=True)
    whole, rate = sampling_plan(requests_per_entry, limit)
    entry_weight = np.where(whole, 1.0, 1.0 / rate)
    kept_entry = whole | (_key_hash(np.arange(len(whole))) < rate * _HASH_SPACE)
    keep = kept_entry[entry]
    ts = requests.ts_ms[keep].astype(np.float64)
    inst, entry = requests.instance[keep].astype(np.int64), entry[keep]
    nbytes, pre = requests.nbytes[keep].astype(np.int64), requests.preinferred[keep].astype(bool)
    by_time = np.lexsort((ts, inst))  # instance by instance: no reuse pair spans two
    ts, inst, entry, nbytes, pre = ts[by_time], inst[by_time], entry[by_time], nbytes[by_time], pre[by_time]
    weight = entry_weight[entry]
    # A sampled entry stands for 1 / rate entries, so its bytes count 1 / rate times in others' distances;
    # in its own, once: it is one entry in its own stack (counted 1 / rate times, a sampled entry's own
    # size alone pushed its distance past small budgets, a bias of −6 points at 20 entries' budget).
    weighted = np.rint(nbytes * weight).astype(np.int64)
    prev, distance = _reuse_distances(entry, weighted)
    distance += nbytes - weighted
    age = np.full(len(ts), np.inf)
    reused = prev >= 0
    age[reused] = ts[reused] - ts[prev[reused]]
    working_set = 0.0
    if len(ts):
        firsts = ~reused
        working_set = float(np.bincount(inst[firsts], weights=(nbytes * weight)[firsts]).max())
    by_key = np.lexsort((ts, entry))
    span = float(ts.max() - ts.min()) if len(ts) else 0.0
    rank = np.cumsum(np.concatenate(([0], entry[by_key][1:] != entry[by_key][:-1])))
    chain_time = rank * (span + 1.0) * 2 + (ts[by_key] - (ts.min() if len(ts) else 0.0))
    return Profile(rate=rate, requests_total=total, entries_whole=int(whole.sum()) if rate < 1 else 0,
                   weight=weight[by_key], distance_bytes=distance[by_key], age_ms=age[by_key],
                   nbytes=nbytes[by_key], preinferred=pre[by_key], first=~reused[by_key], _chain_time=chain_time,
                   _span_ms=span, working_set_bytes=working_set)


@dataclass(frozen=True)
class Point:
    value: float  # the axis's value: bytes for a budget, ms for a TTL
    split: Split


def budget_grid(live: float, working_set: float, smallest: float, points: int = CURVE_POINTS) -> list[float]:
    """Budgets to evaluate: 0, a geometric range from about one entry to past the working set (or four
    times the live budget, whichever is larger), and the live budget itself."""
    hi = max(4 * live, 1.25 * working_set, 2 * smallest, 1.0)
    lo = max(smallest, hi / 4096, 1.0)
    grid = {0.0, float(live), *np.geomspace(lo, hi, points).round().tolist()}
    return sorted(grid)


def ttl_grid(live_ms: float, span_ms: float, points: int = CURVE_POINTS, max_ms: float = 7 * 24 * 3600 * 1000
             ) -> list[float]:
    hi = min(max_ms, max(4 * live_ms, 1.5 * span_ms, 2000.0))
    return sorted({float(live_ms), *np.geomspace(1000.0, hi, points).round().tolist()})


def curves(prof: Profile, hbm_bytes: float, entry_ttl_ms: float, lower: Sequence[TierBudget] = (),
           points: int = CURVE_POINTS) -> dict[str, list[Point]]:
    """One curve per axis, the others at their live values: ``hbm`` (budget per instance), each lower
    tier by name (its budget under the live HBM), ``entry_ttl`` (HBM's TTL, ms)."""
    smallest = float(prof.nbytes.min()) if prof.requests_used else 1.0
    out = {str(Outcome.HBM): [Point(b, prof.split(b, entry_ttl_ms, lower))
                              for b in budget_grid(hbm_bytes, prof.working_set_bytes, smallest, points)]}
    for index, tier in enumerate(lower):
        values = budget_grid(tier.budget_bytes, max(0.0, prof.working_set_bytes - hbm_bytes), smallest, points)
        out[str(tier.name)] = [
            Point(b, prof.split(hbm_bytes, entry_ttl_ms, [*lower[:index], TierBudget(tier.name, b, tier.ttl_ms),
                                                          *lower[index + 1:]]))
            for b in values]
    out["entry_ttl"] = [Point(t, prof.split(hbm_bytes, t, lower))
                        for t in ttl_grid(entry_ttl_ms, prof._span_ms, points)]
    return out


__all__ = ["TIERS", "Point", "Profile", "Requests", "Split", "TierBudget", "curves", "prefix_nbytes", "profile",
           "sampling_plan"]
