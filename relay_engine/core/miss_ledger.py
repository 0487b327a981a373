"""The miss ledger: why a prefix the engine is asked for is in no tier, decided when the miss happens.

The tier stack (``tiers.TierStack``) writes down the last event that made a (user, prefix digest)
absent — dropped for space out of a tier with no tier under it to keep it, expired, refused by the
trigger, cleared by an edit change, a prefill that failed, a copy that failed its checksum — and the
digest each user was last seen with. On a miss the engine asks ``decide``: the key's record, if any;
else a changed prefix (``MissReason.PREFIX_CHANGED``) when the user was seen here with another
digest; else rerouted when the membership moved the user here (the engine's hook); else a first visit.

Keys are (user, digest), not the cache key: an edit change replaces every key's edit hash, and the
request under the new edit must still find the record the clear left.

Bounded: at most ``max_keys`` records and as many users (65,536 each by default, least recently
written first out). Past the bound the oldest record is forgotten: a miss of that key then falls to
the per-user rule (a changed prefix, rerouted or a first visit), and a user forgotten too is taken
for a first visit. Records are not aged: one left by an event long ago still names that event.

One small lock, a leaf (the ledger calls nothing while it holds it), so tiers may write under their own.
Cost: a dict write per loss, per refusal and per kept entry, one pop on a miss, nothing on a hit.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from relay_engine.core.kvcache import CacheKey
from relay_engine.core.telemetry import MissReason

MAX_KEYS = 65_536


class MissLedger:
    def __init__(self, max_keys: int = MAX_KEYS):
        if max_keys < 1:
            raise ValueError(f"max_keys must be ≥ 1, got {max_keys}")
        self.max_keys = max_keys
        self._lost: OrderedDict[tuple[str, str], MissReason] = OrderedDict()
        self._last_digest: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._lost)

    def lost(self, keys: Iterable[CacheKey], reason: MissReason) -> None:
        """``keys`` are absent now because of ``reason`` (the latest such event wins). A tier's
        ``kvcache.LostHook``."""
        with self._lock:
            for key in keys:
                slot = (key.user_id, key.prefix_digest)
                self._lost[slot] = reason
                self._lost.move_to_end(slot)
                if len(self._lost) > self.max_keys:
                    self._lost.popitem(last=False)

    def kept(self, key: CacheKey) -> None:
        """``key`` became resident: an older loss no longer explains a miss; its user was seen with it."""
        with self._lock:
            self._lost.pop((key.user_id, key.prefix_digest), None)
            self._seen(key)

    def decide(self, key: CacheKey, rerouted: Callable[[str], bool]) -> MissReason:
        """The reason of a miss of ``key`` (its record is used up). ``rerouted(user_id)``: whether the
        membership moved that user here; asked only for a user this ledger has not seen."""
        with self._lock:
            reason = self._lost.pop((key.user_id, key.prefix_digest), None)
            last = self._last_digest.get(key.user_id)
            self._seen(key)
        if reason is not None:
            return reason
        if last is not None:
            return MissReason.PREFIX_CHANGED if last != key.prefix_digest else MissReason.FIRST_VISIT
        return MissReason.REROUTED if rerouted(key.user_id) else MissReason.FIRST_VISIT

    def _seen(self, key: CacheKey) -> None:
        """The user's latest digest (lock held)."""
        self._last_digest[key.user_id] = key.prefix_digest
        self._last_digest.move_to_end(key.user_id)
        if len(self._last_digest) > self.max_keys:
            self._last_digest.popitem(last=False)
