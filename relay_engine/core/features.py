"""Token ids for trace queries: the project's stand-in for a feature store.

A trace carries only lengths. ``SyntheticFeatures`` derives the tokens deterministically: a user's
long-term prefix from (user_id, seq_len) — the same user with the same length is the same prefix,
so repeats can hit the cache — and the short-term tokens and candidates from the query's index.
Workers, the benchmark and the simulator use the same derivation.

``AliasMap`` is the feature side's id canonicalisation: an item logged under two ids is one token
for the model once the map has rewritten its histories.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

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
