"""A new tier under HBM is its module, its entry in ``lower_tiers.LOWER_TIERS`` and its tests: nothing
else names it. Shown by registering a throwaway fourth tier (an in-memory one, defined here) in a fresh
interpreter, before the core is imported, and following it through the engine: its outcome, its
counter, its policy section (parsed, hashed, its errors named by field) and its per-tier figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from relay_engine.core.config import parse_policy

ROOT = Path(__file__).resolve().parents[2]

# Run as ``__main__`` in a fresh interpreter: the tier's module is this script itself.
FOURTH_TIER = r'''
import json, sys, threading
from collections import OrderedDict

from relay_engine.core import lower_tiers

lower_tiers.LOWER_TIERS.append(lower_tiers.LowerTierEntry(
    "scratch", "scratch hit", "__main__", lower_tiers.PolicySection(
        "Scratch tier", "An in-memory tier under the others, for this test.", "Use a scratch tier", (
            lower_tiers.number_field("budget_mb", 1.0, 0.0, 64.0, label="Scratch budget", unit="MiB",
                                     help="Bytes the scratch tier holds."),
        ))))

from relay_engine.core.config import BYTES_PER_MIB, PolicyError, parse_policy
from relay_engine.core.engine import RankRequest, RelayEngine
from relay_engine.core.outcomes import OUTCOME_COUNTERS, TIERS, Outcome, TierCounters
from relay_engine.core.telemetry import COUNTERS
from relay_engine.core.tiers import LowerTier
from tests.models import SMALL, make_history


class ScratchTier:
    """Entries in a dict, least recently stored evicted first."""

    name = Outcome.SCRATCH

    def __init__(self, budget_bytes):
        self.budget_bytes, self.ttl_s, self.on_evict = budget_bytes, 3600.0, None
        self.counters = TierCounters()
        self._entries = OrderedDict()
        self._lock = threading.Lock()

    @property
    def used_bytes(self):
        return sum(kv.nbytes for kv in self._entries.values())

    def __contains__(self, key):
        return key in self._entries

    def __len__(self):
        return len(self._entries)

    def lookup(self, key):
        with self._lock:
            kv = self._entries.pop(key, None)
            self.counters.hits += kv is not None
            return kv

    def admit(self, key, kv):
        with self._lock:
            while self._entries and self.used_bytes + kv.nbytes > self.budget_bytes:
                self._entries.popitem(last=False)
                self.counters.evictions += 1
            if kv.nbytes > self.budget_bytes:
                self.counters.rejected += 1
                return False
            self._entries[key] = kv
            self.counters.admissions += 1
            self.counters.peak_bytes = max(self.counters.peak_bytes, self.used_bytes)
            return True

    def discard(self, key):
        self._entries.pop(key, None)

    def expire(self):
        return 0

    def resize(self, budget_bytes, ttl_s):
        self.budget_bytes = budget_bytes

    def clear(self):
        self._entries.clear()

    def flush(self, timeout_s=None):
        return True

    def close(self):
        pass


def build(cache, site, current):
    if cache.scratch is None:
        return None
    budget_bytes = int(cache.scratch.budget_mb * BYTES_PER_MIB)
    tier = current if current is not None else ScratchTier(budget_bytes)
    tier.resize(budget_bytes, 3600.0)
    return tier


LOWER_TIER = LowerTier(Outcome.SCRATCH, build=build, check=lambda cache: None)

default_sha256 = sys.argv[1]
per_prefix = SMALL.kv_bytes_per_token() * 200
mib = per_prefix / 2**20
policy = {"cache": {"hbm_budget_mb": 2.5 * mib, "dram_budget_mb": 1.5 * mib, "scratch": {"budget_mb": 4 * mib}}}
engine = RelayEngine(SMALL, device="cpu", policy=parse_policy(policy))
short = make_history(8, SMALL, seed=100)
prefixes = {u: make_history(200, SMALL, seed=i) for i, u in enumerate(["u1", "u2", "u3", "u4"])}
for user, prefix in prefixes.items():  # HBM holds two, DRAM one: u1 goes down to the scratch tier
    engine.rank(RankRequest(user, prefix, short, list(range(20))))
engine.cache.flush(5.0)
source = engine.rank(RankRequest("u1", prefixes["u1"], short, list(range(20)))).source
stats = engine.stats()
try:
    parse_policy({"cache": {"scratch": {"budget_mb": 65, "size": 1}}})
    errors = {}
except PolicyError as exc:
    errors = exc.errors
print(json.dumps({
    "outcomes": [str(o) for o in Outcome],
    "label": Outcome.SCRATCH.label,
    "tiers": [str(t) for t in TIERS],
    "counter": OUTCOME_COUNTERS[Outcome.SCRATCH],
    "counter_carried": OUTCOME_COUNTERS[Outcome.SCRATCH] in COUNTERS,
    "source": str(source),
    "scratch_hits": stats.counters[OUTCOME_COUNTERS[Outcome.SCRATCH]],
    "figures": stats.tiers["scratch"].to_dict(),
    "default_unchanged": parse_policy({}).sha256() == default_sha256,
    "section": parse_policy(policy).to_dict()["cache"]["scratch"],
    "off_by_default": "scratch" not in parse_policy({}).to_dict()["cache"],
    "errors": errors,
}))
'''


def test_a_fourth_tier_registered_in_one_entry_is_looked_up_counted_parsed_and_reported(tmp_path):
    script = tmp_path / "fourth_tier.py"
    script.write_text(FOURTH_TIER)
    done = subprocess.run([sys.executable, str(script), parse_policy({}).sha256()], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["outcomes"] == ["hbm", "inflight", "dram", "disk", "scratch", "miss"]
    assert seen["label"] == "scratch hit" and seen["tiers"] == ["hbm", "dram", "disk", "scratch"]
    assert seen["counter"] == "scratch_hits" and seen["counter_carried"]
    # looked up (the rank was served from it) and counted, by the engine and by the tier
    assert seen["source"] == "scratch" and seen["scratch_hits"] == 1
    assert seen["figures"]["hits"] == 1 and seen["figures"]["admissions"] >= 1
    assert seen["figures"]["budget_bytes"] > 0
    # parsed from the policy, off by default, leaving the hash of a spec without it alone
    assert seen["default_unchanged"] and seen["off_by_default"]
    assert set(seen["section"]) == {"budget_mb"}
    assert seen["errors"] == {"cache.scratch.budget_mb": ["must be in [0, 64], got 65"],
                              "cache.scratch.size": ["unknown field; allowed: budget_mb"]}
