"""The affinity router: one user → one instance, the same for the pre-infer signal and ranking.

Rendezvous (highest-random-weight) hashing: each (user, instance) pair gets a pseudo-random
weight and the user goes to the heaviest instance, so removing an instance moves only its own
users and adding one takes about 1/n of everybody's. A bounded-load fallback ((1 + ε) × the mean
load) walks down the user's ranking when the first choice is overloaded, so a few hot users cannot
swamp one instance; under normal load it never triggers and affinity is exact. Pure logic.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping

# Users whose route a router remembers: a user's pre-infer signal and its ranking request, and the
# users who come back (Zipf), are routed once per member set instead of hashing every member again.
ROUTE_CACHE_SIZE = 65_536


class AffinityRouter:
    def __init__(self, instances: Iterable[str], epsilon: float = 0.25):
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
        self.epsilon = epsilon
        self._instances: tuple[str, ...] = ()
        self._salts: dict[str, bytes] = {}
        self.set_instances(instances)

    @property
    def instances(self) -> tuple[str, ...]:
        return self._instances

    def set_instances(self, instances: Iterable[str]) -> None:
        names = tuple(sorted(set(instances)))
        self._instances = names
        # blake2b keys are at most 64 bytes; hash long names down to a fixed-size salt.
        self._salts = {n: hashlib.blake2b(n.encode(), digest_size=32).digest() for n in names}
        # A (user, instance) weight is the 8-byte blake2b of the user id keyed by the instance's salt;
        # keyed once here, a weight is then a copy and one update (the key block is not hashed again).
        self._hashers = {n: hashlib.blake2b(digest_size=8, key=salt) for n, salt in self._salts.items()}
        self._heaviest_cached = functools.lru_cache(maxsize=ROUTE_CACHE_SIZE)(self._heaviest)
        self._ranking_cached = functools.lru_cache(maxsize=ROUTE_CACHE_SIZE)(self._ranking)

    def _weights(self, user_id: str) -> dict[str, int]:
        data = user_id.encode()
        weights = {}
        for name, keyed in self._hashers.items():
            hasher = keyed.copy()
            hasher.update(data)
            weights[name] = int.from_bytes(hasher.digest(), "big")
        return weights

    def _heaviest(self, user_id: str) -> str:
        weights = self._weights(user_id)
        return max(weights, key=weights.__getitem__)

    def _ranking(self, user_id: str) -> tuple[str, ...]:
        weights = self._weights(user_id)
        return tuple(sorted(self._instances, key=weights.__getitem__, reverse=True))

    def ranking(self, user_id: str) -> list[str]:
        """Instances in the user's preference order (highest weight first); remembered per member set
        for the most recent users, as the bounded-load fallback walks it on every loaded route."""
        return list(self._ranking_cached(user_id))

    def route(self, user_id: str, loads: Mapping[str, float] | None = None) -> str:
        """The instance for user_id. ``loads`` (e.g. requests in flight per instance) enables the
        bounded-load fallback; without it the route is the pure rendezvous choice."""
        if not self._instances:
            raise LookupError("no live instances to route to")
        if not loads:
            return self._heaviest_cached(user_id)
        total = sum(max(0.0, load) for name, load in loads.items() if name in self._salts)
        capacity = (1.0 + self.epsilon) * (total + 1.0) / len(self._instances)
        ranked = self._ranking_cached(user_id)
        for name in ranked:
            if loads.get(name, 0.0) + 1.0 <= capacity:
                return name
        return ranked[0]
