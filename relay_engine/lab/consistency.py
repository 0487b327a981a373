"""Semantic consistency and ranking quality of a GR model on synthetic users.

Consistency: for pairs of equivalent histories (a canonical writing and one rewrite, see
``synthetic.REWRITES``) over the same candidates, the share of pairs whose top-10 is the same set,
the mean top-10 overlap, the rank-biased overlap of the two top-10 lists (RBO, Webber et al. 2010:
rank-aware, so a swap at rank 10/11 costs little and one at rank 1 a lot) and Kendall's τ between
the two score vectors — overall and per kind of rewrite. Top-10 identity alone is fragile: most
failures of the rewrites that keep every id are a single swap at the cut-off, which the overlap
and RBO see as the near miss it is. Quality: NDCG@10 and HR@10 of the user's held-out next items.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relay_engine.core.features import Canonicaliser
from relay_engine.core.model import EditTensors, HSTUModel
from relay_engine.lab.synthetic import (
    INFORMATION_PRESERVING,
    REWRITES,
    SyntheticUser,
    SyntheticWorld,
    UserHistory,
)

TOP_K = 10
RBO_PERSISTENCE = 0.9  # RBO's p: the weight of rank d is p^(d-1)


@dataclass(frozen=True)
class EquivalentPair:
    user_id: int
    kind: str  # one of REWRITES
    original: UserHistory
    rewritten: UserHistory


@dataclass(frozen=True)
class Consistency:
    top10_same: float  # share of pairs with the same top-10 set
    top10_overlap: float  # mean |top10(a) ∩ top10(b)| / 10
    kendall_tau: float  # mean τ over pairs
    by_kind: dict[str, float] = field(default_factory=dict)  # top10_same per rewrite kind
    pairs: int = 0
    same_by_pair: tuple[bool, ...] = field(default=(), repr=False)  # in the order of the pairs given
    top10_rbo: float = 0.0  # mean rank-biased overlap of the top-10 lists
    overlap_by_kind: dict[str, float] = field(default_factory=dict)
    rbo_by_kind: dict[str, float] = field(default_factory=dict)
    kind_by_pair: tuple[str, ...] = field(default=(), repr=False)
    overlap_by_pair: tuple[float, ...] = field(default=(), repr=False)
    rbo_by_pair: tuple[float, ...] = field(default=(), repr=False)

    def same_share(self, kinds: Sequence[str] = INFORMATION_PRESERVING) -> float:
        """top10_same over the pairs of these kinds only (by default those that keep every id)."""
        chosen = [s for s, k in zip(self.same_by_pair, self.kind_by_pair, strict=True) if k in kinds]
        return float(np.mean(chosen)) if chosen else float("nan")


@dataclass(frozen=True)
class Quality:
    ndcg10: float
    hr10: float
    queries: int
    ndcg_by_query: tuple[float, ...] = field(default=(), repr=False)  # users in the order given, targets in order


def equivalent_pairs(world: SyntheticWorld, user_ids: Sequence[int],
                     kinds: Sequence[str] = REWRITES) -> list[EquivalentPair]:
    """One pair per (user, rewrite kind): the canonical history and its rewrite (seeded by user)."""
    pairs = []
    for uid in user_ids:
        user = world.user(int(uid))
        g = np.random.default_rng([world.config.seed, 3, int(uid)])
        for kind in kinds:
            pairs.append(EquivalentPair(int(uid), kind, user.history, world.rewrite(user.history, kind, g)))
    return pairs


def score(model: HSTUModel, history: UserHistory, candidates: torch.Tensor, edit: EditTensors | None = None,
          head_capture: list[torch.Tensor] | None = None, canonical: Canonicaliser | None = None) -> torch.Tensor:
    """Scores of the candidates [C] for a history (under ``edit``; none by default), canonicalised first
    when ``canonical`` is given (an ``AliasMap``, an ``EventDedup`` or both in a ``Canonical``)."""
    h = history.to_history()
    if canonical is not None:
        h = canonical.apply(h)
    with torch.no_grad():
        _, scores = model.forward(h, candidates, edit=edit, head_capture=head_capture)
    return scores.cpu()


def top_k(scores: torch.Tensor, k: int = TOP_K) -> torch.Tensor:
    """Indices of the k best scores, best first; ties broken by the lower index (deterministic)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[:k]


def kendall_tau(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's τ-a between two score vectors [C] (pairs tied in either count as discordant-free 0)."""
    da = torch.sign(a[:, None] - a[None, :])
    db = torch.sign(b[:, None] - b[None, :])
    n = a.shape[0]
    return float((da * db).sum() / (n * (n - 1)))


def top_k_same(a: torch.Tensor, b: torch.Tensor, k: int = TOP_K) -> bool:
    return set(top_k(a, k).tolist()) == set(top_k(b, k).tolist())


def rank_biased_overlap(a: torch.Tensor, b: torch.Tensor, k: int = TOP_K, p: float = RBO_PERSISTENCE) -> float:
    """RBO of the two top-k lists, normalised to 1 for the same list: Σ_d p^(d-1)·|A_d ∩ B_d|/d over
    depths d = 1…k (A_d: the first d of a's ranking), divided by Σ_d p^(d-1)."""
    ta, tb = top_k(a, k).tolist(), top_k(b, k).tolist()
    seen_a: set[int] = set()
    seen_b: set[int] = set()
    common = total = norm = 0.0
    for d in range(1, k + 1):
        x, y = ta[d - 1], tb[d - 1]
        common += (x in seen_b) + (y in seen_a) + (x == y)
        seen_a.add(x)
        seen_b.add(y)
        total += p ** (d - 1) * common / d
        norm += p ** (d - 1)
    return total / norm


def consistency(model: HSTUModel, world: SyntheticWorld, pairs: Sequence[EquivalentPair],
                edit: EditTensors | None = None, canonical: Canonicaliser | None = None) -> Consistency:
    """Consistency of each pair's two writings under ``edit`` (both canonicalised first when ``canonical``
    is given)."""
    candidates = world.candidates()
    same, overlap, rbo, taus = [], [], [], []
    original_scores: dict[int, torch.Tensor] = {}
    for p in pairs:
        if p.user_id not in original_scores:
            original_scores[p.user_id] = score(model, p.original, candidates, edit, canonical=canonical)
        a = original_scores[p.user_id]
        b = score(model, p.rewritten, candidates, edit, canonical=canonical)
        same.append(top_k_same(a, b))
        overlap.append(len(set(top_k(a).tolist()) & set(top_k(b).tolist())) / TOP_K)
        rbo.append(rank_biased_overlap(a, b))
        taus.append(kendall_tau(a, b))
    kinds = tuple(p.kind for p in pairs)

    def by_kind(values: list) -> dict[str, float]:
        return {k: float(np.mean([v for v, kk in zip(values, kinds, strict=True) if kk == k]))
                for k in dict.fromkeys(kinds)}

    return Consistency(float(np.mean(same)), float(np.mean(overlap)), float(np.mean(taus)), by_kind(same),
                       len(pairs), tuple(same), float(np.mean(rbo)), by_kind(overlap), by_kind(rbo), kinds,
                       tuple(overlap), tuple(rbo))


def quality(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int],
            edit: EditTensors | None = None, *, logged: bool = False, canonical: Canonicaliser | None = None) -> Quality:
    """NDCG@10 / HR@10 of each user's held-out next items, ranked among all canonical items, from their
    canonical history (or, with ``logged``, the history as the log wrote it: aliases, duplicates)."""
    candidates = world.candidates()
    return _next_item_quality(world, user_ids, lambda user: score(
        model, user.logged if logged else user.history, candidates, edit, canonical=canonical))


def oracle_quality(world: SyntheticWorld, user_ids: Sequence[int]) -> Quality:
    """The same metrics for the generator's own ranking: the ceiling a model can reach."""
    return _next_item_quality(world, user_ids, lambda user: torch.from_numpy(world.ideal_scores(user)))


def _next_item_quality(world: SyntheticWorld, user_ids: Sequence[int],
                       scores_of: Callable[[SyntheticUser], torch.Tensor]) -> Quality:
    ndcg, hits = [], []
    for uid in user_ids:
        user = world.user(int(uid))
        scores = scores_of(user)  # [N]
        for t in user.targets:
            rank = int((scores > scores[int(t)]).sum())  # candidates scoring strictly higher
            hits.append(rank < TOP_K)
            ndcg.append(1.0 / np.log2(rank + 2) if rank < TOP_K else 0.0)
    return Quality(float(np.mean(ndcg)), float(np.mean(hits)), len(ndcg), tuple(ndcg))


@dataclass(frozen=True)
class PairedRun:
    """One base model's test measurements, unedited and edited, on the same pairs and next items."""

    before: Consistency
    after: Consistency
    before_q: Quality
    after_q: Quality


def paired_user_bootstrap(runs: Sequence[PairedRun], *, pair_users: int, query_users: int, samples: int = 2000,
                          seed: int = 0) -> dict[str, Any]:
    """95 % intervals of the consistency gains (points) and the relative NDCG@10 change, averaged over
    the runs (one per base-model seed), users resampled.

    Pairs come grouped by user (``pair_users`` users, the same kinds of rewrite each, in the same
    order) and next-item queries too (``query_users``). A resample draws users once and scores every
    run, unedited and edited, on that draw, so the interval reflects which users were drawn, not
    independent draws. Gains: all pairs (``gain_points_95``), the rewrites that keep every id
    (``non_alias_gain_points_95``), each rewrite (``gain_by_rewrite_95``), and the same for the mean
    top-10 overlap and RBO on the id-keeping rewrites.
    """
    kinds = np.asarray(runs[0].before.kind_by_pair).reshape(pair_users, -1)[0]  # the kinds of one user's pairs
    keep = np.isin(kinds, INFORMATION_PRESERVING)

    def per_user(values: tuple) -> np.ndarray:
        return np.asarray(values, dtype=float).reshape(pair_users, -1)  # [users, kinds]

    same = [(per_user(r.before.same_by_pair), per_user(r.after.same_by_pair)) for r in runs]
    overlap = [(per_user(r.before.overlap_by_pair), per_user(r.after.overlap_by_pair)) for r in runs]
    rbo = [(per_user(r.before.rbo_by_pair), per_user(r.after.rbo_by_pair)) for r in runs]
    ndcg = [(np.asarray(r.before_q.ndcg_by_query).reshape(query_users, -1),
             np.asarray(r.after_q.ndcg_by_query).reshape(query_users, -1)) for r in runs]
    g = np.random.default_rng(seed)
    stats: dict[str, list[float]] = {}

    def gain(grids: list[tuple[np.ndarray, np.ndarray]], users: np.ndarray, cols: np.ndarray | slice) -> float:
        return float(np.mean([100 * (a[users][:, cols].mean() - b[users][:, cols].mean()) for b, a in grids]))

    for _ in range(samples):
        pu = g.integers(0, pair_users, pair_users)
        qu = g.integers(0, query_users, query_users)
        draws = {"gain_points_95": gain(same, pu, slice(None)), "non_alias_gain_points_95": gain(same, pu, keep),
                 "non_alias_overlap_gain_points_95": gain(overlap, pu, keep),
                 "non_alias_rbo_gain_points_95": gain(rbo, pu, keep),
                 "ndcg10_change_95": float(np.mean([a[qu].mean() / b[qu].mean() - 1 if b[qu].mean() else 0.0
                                                    for b, a in ndcg]))}
        draws.update({f"rewrite:{k}": gain(same, pu, kinds == k) for k in kinds})
        for key, value in draws.items():
            stats.setdefault(key, []).append(value)
    out: dict[str, Any] = {key: _interval(v) for key, v in stats.items() if not key.startswith("rewrite:")}
    out["gain_by_rewrite_95"] = {k: _interval(stats[f"rewrite:{k}"]) for k in kinds}
    return out


def paired_quality_bootstrap(before: Quality, after: Quality, *, query_users: int, samples: int = 2000,
                             seed: int = 0) -> list[float]:
    """95 % interval of the relative NDCG@10 change between two measurements of the same queries, users resampled."""
    b = np.asarray(before.ndcg_by_query).reshape(query_users, -1)
    a = np.asarray(after.ndcg_by_query).reshape(query_users, -1)
    g = np.random.default_rng(seed)
    draws = []
    for _ in range(samples):
        qu = g.integers(0, query_users, query_users)
        base = b[qu].mean()
        draws.append(a[qu].mean() / base - 1 if base else 0.0)
    return _interval(draws)


def _interval(values: Sequence[float]) -> list[float]:
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]
