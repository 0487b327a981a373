"""Token ids for trace queries: the project's stand-in for a feature store.

A trace carries only lengths. ``SyntheticFeatures`` derives the tokens deterministically: a user's
long-term prefix from (user_id, seq_len) — the same user with the same length is the same prefix,
so repeats can hit the cache — and the short-term tokens and candidates from the query's index.
Workers, the benchmark and the simulator use the same derivation.
"""

from __future__ import annotations

import hashlib

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
