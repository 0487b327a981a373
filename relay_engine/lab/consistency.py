"""Semantic consistency and ranking quality of a GR model on synthetic users.

Consistency: for pairs of equivalent histories (a canonical writing and one rewrite, see
``synthetic.REWRITES``) over the same candidates, the share of pairs whose top-10 is the same set,
the mean top-10 overlap, and Kendall's τ between the two score vectors. Quality: NDCG@10 and HR@10
of the user's held-out next items.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from relay_engine.core.model import HeadBias, HSTUModel
from relay_engine.lab.synthetic import REWRITES, SyntheticUser, SyntheticWorld, UserHistory

TOP_K = 10


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


def score(model: HSTUModel, history: UserHistory, candidates: torch.Tensor, edit: HeadBias | None = None,
          head_capture: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Scores of the candidates [C] for a history (under ``edit``; none by default)."""
    with torch.no_grad():
        _, scores = model.forward(history.to_history(), candidates, edit=edit, head_capture=head_capture)
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


def consistency(model: HSTUModel, world: SyntheticWorld, pairs: Sequence[EquivalentPair],
                edit: HeadBias | None = None) -> Consistency:
    candidates = world.candidates()
    same, overlap, taus = [], [], []
    by_kind: dict[str, list[bool]] = {}
    original_scores: dict[int, torch.Tensor] = {}
    for p in pairs:
        if p.user_id not in original_scores:
            original_scores[p.user_id] = score(model, p.original, candidates, edit)
        a = original_scores[p.user_id]
        b = score(model, p.rewritten, candidates, edit)
        is_same = top_k_same(a, b)
        same.append(is_same)
        by_kind.setdefault(p.kind, []).append(is_same)
        overlap.append(len(set(top_k(a).tolist()) & set(top_k(b).tolist())) / TOP_K)
        taus.append(kendall_tau(a, b))
    return Consistency(float(np.mean(same)), float(np.mean(overlap)), float(np.mean(taus)),
                       {k: float(np.mean(v)) for k, v in by_kind.items()}, len(pairs), tuple(same))


def quality(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int],
            edit: HeadBias | None = None) -> Quality:
    """NDCG@10 / HR@10 of each user's held-out next items, ranked among all canonical items."""
    candidates = world.candidates()
    return _next_item_quality(world, user_ids, lambda user: score(model, user.history, candidates, edit))


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


def paired_user_bootstrap(before: Consistency, after: Consistency, before_q: Quality, after_q: Quality, *,
                          pair_users: int, query_users: int, samples: int = 2000,
                          seed: int = 0) -> dict[str, list[float]]:
    """95 % intervals of the consistency gain (points) and the relative NDCG@10 change, users resampled.

    Pairs come grouped by user (``pair_users`` users, the same number of pairs each) and next-item
    queries too (``query_users``); both measurements of a resample use the same users, so the
    interval reflects which users were drawn, not two independent draws.
    """
    same_b = np.asarray(before.same_by_pair, dtype=float).reshape(pair_users, -1)
    same_a = np.asarray(after.same_by_pair, dtype=float).reshape(pair_users, -1)
    nd_b = np.asarray(before_q.ndcg_by_query).reshape(query_users, -1)
    nd_a = np.asarray(after_q.ndcg_by_query).reshape(query_users, -1)
    g = np.random.default_rng(seed)
    gain, change = np.empty(samples), np.empty(samples)
    for i in range(samples):
        pu = g.integers(0, pair_users, pair_users)
        qu = g.integers(0, query_users, query_users)
        gain[i] = 100 * (same_a[pu].mean() - same_b[pu].mean())
        base = nd_b[qu].mean()
        change[i] = nd_a[qu].mean() / base - 1 if base else 0.0
    return {"gain_points_95": [float(v) for v in np.percentile(gain, [2.5, 97.5])],
            "ndcg10_change_95": [float(v) for v in np.percentile(change, [2.5, 97.5])]}
