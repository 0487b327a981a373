"""Token ids for trace queries: the project's stand-in for a feature store.

A trace carries only lengths. ``SyntheticFeatures`` derives the tokens deterministically: a user's
long-term prefix from (user_id, seq_len) — the same user with the same length is the same prefix,
so repeats can hit the cache — and the short-term tokens and candidates from the query's index.
Workers, the benchmark and the simulator use the same derivation.

The feature side's canonicalisations, applied to histories before the model sees them (and so
before the prefix digest, the cache key, is taken): ``AliasMap`` (an item logged under two ids is one
token) and ``EventDedup`` (an event the log wrote twice is one event). Each has ``apply(History) ->
History``; ``Canonical`` runs several in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from relay_engine.core.model import History, ModelConfig
from relay_engine.core.trace import MAX_TRACE_SEQ_LEN


def _seed(*parts: object) -> int:
    text = "\x1f".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") & ((1 << 63) - 1)


class SyntheticFeatures:
    """Token ids for trace queries, deterministic in (user_id, seq_len) and the query index."""

    def __init__(self, config: ModelConfig, *, with_timestamps: bool = False, seed: int = 0,
                 start_ts: int = 1_700_000_000):
        self.config = config
        self.with_timestamps = with_timestamps
        self.seed = seed
        self.start_ts = start_ts

    def _history(self, seed: int, length: int, t0: int) -> History:
        g = torch.Generator().manual_seed(seed)
        items = torch.randint(self.config.min_item_id, self.config.num_items, (length,), generator=g)
        actions = torch.randint(1, self.config.num_actions, (length,), generator=g)
        ts = None
        if self.with_timestamps:
            gaps = torch.randint(1, 3600, (length,), generator=g)
            ts = t0 + torch.cumsum(gaps, 0)
        return History(items, actions, ts)

    def prefix(self, user_id: str, seq_len: int) -> History:
        return self._history(_seed(self.seed, "prefix", user_id, seq_len), seq_len, self.start_ts)

    def short_term(self, user_id: str, query_index: int, short_len: int) -> History:
        # Short-term events happen after the whole long-term history (~1 h per event above).
        t0 = self.start_ts + 3600 * (MAX_TRACE_SEQ_LEN // 1024) * 1024
        return self._history(_seed(self.seed, "short", user_id, query_index), short_len, t0)

    def candidates(self, query_index: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_seed(self.seed, "cands", query_index))
        return torch.randint(self.config.min_item_id, self.config.num_items, (n,), generator=g)


class AliasMap:
    """Item id canonicalisation, applied to histories before the model sees them.

    ``canonical_of[i]`` is the id item i is written under for the model: itself, or the canonical id
    of which i is an alias. It must be idempotent (a canonical id maps to itself), so applying the
    map twice is applying it once. Applied to the prefix and the short-term tokens alike, the prefix
    digest (the cache key) is taken over the canonical ids: two writings of one history share a cache
    entry. This is what makes alias rewrites consistent — no head edit can make an id that the model
    barely learned mean the same as the id it stands for.
    """

    def __init__(self, canonical_of: Sequence[int] | np.ndarray | torch.Tensor):
        table = torch.as_tensor(np.asarray(canonical_of), dtype=torch.int64)
        if table.dim() != 1 or table.numel() == 0:
            raise ValueError(f"alias_map: must be a non-empty 1-D list of item ids, got shape {list(table.shape)}")
        n = table.numel()
        out_of_range = ((table < 0) | (table >= n)).nonzero()
        if out_of_range.numel():
            i = int(out_of_range[0])
            raise ValueError(f"alias_map[{i}]: {int(table[i])} is not an item id in [0, {n - 1}]")
        chained = (table[table] != table).nonzero()
        if chained.numel():
            i = int(chained[0])
            raise ValueError(f"alias_map[{i}]: maps to {int(table[i])}, which is itself an alias of "
                             f"{int(table[table[i]])}; map every id straight to its canonical id")
        self.canonical_of = table

    @property
    def num_items(self) -> int:
        return self.canonical_of.numel()

    def apply(self, history: History) -> History:
        """The same history with every item under its canonical id (actions and timestamps kept)."""
        if history.items.numel() and not 0 <= int(history.items.min()) <= int(history.items.max()) < self.num_items:
            raise ValueError(f"items: ids must be in [0, {self.num_items - 1}], the alias map's range")
        table = self.canonical_of.to(history.items.device)
        return History(table[history.items], history.actions, history.timestamps)


class Canonicaliser(Protocol):
    def apply(self, history: History) -> History: ...


class EventDedup:
    """Exact repeats of one event collapsed to the first: an event with the same item and action as the
    one just before it, logged within ``tolerance_s`` seconds of it (a log that wrote one behaviour twice;
    a run of repeats collapses whole). Only adjacent repeats: the same item seen again after something
    else is a behaviour of its own. Needs timestamps: a history without them is returned as it is (a
    repeat with no time to tell it from a second view is kept).

    Like aliases, duplicates are undone here, where they are made, rather than by an edit of the model:
    no map of head outputs can make a history with an extra token read as the one without it.
    """

    def __init__(self, tolerance_s: float = 1.0):
        if not tolerance_s >= 0:
            raise ValueError(f"tolerance_s: must be a number of seconds ≥ 0, got {tolerance_s!r}")
        self.tolerance_s = float(tolerance_s)

    def apply(self, history: History) -> History:
        ts = history.timestamps
        if ts is None or len(history) < 2:
            return history
        items, actions = history.items, history.actions
        repeat = ((items[1:] == items[:-1]) & (actions[1:] == actions[:-1])
                  & ((ts[1:] - ts[:-1]).abs() <= self.tolerance_s))
        if not bool(repeat.any()):
            return history
        keep = torch.cat([torch.ones(1, dtype=torch.bool, device=repeat.device), ~repeat])
        return History(items[keep], actions[keep], ts[keep])


class Canonical:
    """Several canonicalisations applied in order (for example ``Canonical(AliasMap(...), EventDedup())``:
    ids first, so that an event logged once under each of two ids is a repeat too)."""

    def __init__(self, *steps: Canonicaliser):
        self.steps = steps

    def apply(self, history: History) -> History:
        for step in self.steps:
            history = step.apply(history)
        return history
