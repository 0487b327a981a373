"""The affinity router: one user → one instance, the same for the pre-infer signal and ranking.

Rendezvous (highest-random-weight) hashing: each (user, instance) pair gets a pseudo-random
weight and the user goes to the heaviest instance, so removing an instance moves only its own
users and adding one takes about 1/n of everybody's. A bounded-load fallback ((1 + ε) × the mean
load) walks down the user's ranking when the first choice is overloaded, so a few hot users cannot
swamp one instance; under normal load it never triggers and affinity is exact. Pure logic.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping

RANKING_CACHE_USERS = 65_536  # users whose instance order is remembered (a route is then a lookup)


def _weight(user_id: str, instance_salt: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(user_id.encode(), digest_size=8, key=instance_salt).digest(), "big")


class AffinityRouter:
    def __init__(self, instances: Iterable[str], epsilon: float = 0.25):
        if not (epsilon > 0 and math.isfinite(epsilon)):
            raise ValueError(f"epsilon must be a positive finite number, got {epsilon}")
        self.epsilon = epsilon
        self._instances: tuple[str, ...] = ()
        self._salts: dict[str, bytes] = {}
        self._rankings: OrderedDict[str, list[str]] = OrderedDict()
        self._rankings_lock = threading.Lock()  # one router serves a client's many threads
        self.set_instances(instances)

    @property
    def instances(self) -> tuple[str, ...]:
        return self._instances

    def set_instances(self, instances: Iterable[str]) -> None:
        names = tuple(sorted(set(instances)))
        # blake2b keys are at most 64 bytes; hash long names down to a fixed-size salt.
        salts = {n: hashlib.blake2b(n.encode(), digest_size=32).digest() for n in names}
        with self._rankings_lock:
            self._instances, self._salts = names, salts
            self._rankings = OrderedDict()

    def ranking(self, user_id: str) -> list[str]:
        """Instances in the user's preference order (highest weight first). Remembered for the most
        recent users (a bounded LRU), since a user's order changes only with the instance set."""
        with self._rankings_lock:
            ranked = self._rankings.get(user_id)
            if ranked is not None:
                self._rankings.move_to_end(user_id)
                return ranked
            instances, salts = self._instances, self._salts
        ranked = sorted(instances, key=lambda n: _weight(user_id, salts[n]), reverse=True)
        with self._rankings_lock:
            if self._instances is instances:  # not computed for a set replaced meanwhile
                self._rankings[user_id] = ranked
                if len(self._rankings) > RANKING_CACHE_USERS:
                    self._rankings.popitem(last=False)
        return ranked

    def route(self, user_id: str, loads: Mapping[str, float] | None = None) -> str:
        """The instance for user_id. ``loads`` (e.g. requests in flight per instance) enables the
        bounded-load fallback; without it the route is the pure rendezvous choice."""
        if not self._instances:
            raise LookupError("no live instances to route to")
        if not loads:
            return self.ranking(user_id)[0]
        total = sum(max(0.0, load) for name, load in loads.items() if name in self._salts)
        capacity = (1.0 + self.epsilon) * (total + 1.0) / len(self._instances)
        ranked = self.ranking(user_id)
        for name in ranked:
            if loads.get(name, 0.0) + 1.0 <= capacity:
                return name
        return ranked[0]
