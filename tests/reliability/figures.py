"""The figures of the closing note, gathered while the tests run: load held during the faults,
faults injected and survived, hostile inputs tried, requests lost.

Tests add to one ``Figures`` per session; ``tests/reliability/conftest.py`` prints them at the end and
writes them to ``artifacts/reliability/figures.json``.
"""

from __future__ import annotations

import copy
import json
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path

ARTIFACT = Path(__file__).resolve().parents[2] / "artifacts" / "reliability" / "figures.json"


@dataclass
class Figures:
    faults_injected: list[str] = field(default_factory=list)
    faults_survived: list[str] = field(default_factory=list)
    hostile_inputs: dict[str, int] = field(default_factory=dict)
    rank_requests: int = 0
    rank_ok: int = 0
    rank_clear_errors: int = 0
    requests_lost: int = 0
    rank_outcomes: dict[str, int] = field(default_factory=dict)
    load_seconds: float = 0.0
    # fault → ranking requests sent during its test: sent, answered, failed_clearly, lost
    fault_load: dict[str, dict[str, int]] = field(default_factory=dict)
    # database vendor → operation → HTTP status → count, from tests/controlplane/test_concurrency.py
    concurrent_writes_by_db: dict[str, dict[str, dict[int, int]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fault(self, name: str) -> FaultRecord:
        with self._lock:
            self.faults_injected.append(name)
        return FaultRecord(self, name)

    def hostile(self, family: str, count: int = 1) -> None:
        with self._lock:
            self.hostile_inputs[family] = self.hostile_inputs.get(family, 0) + count

    def fault_requests(self, fault: str, *, outcomes: dict[str, int], lost: int) -> None:
        """The ranking requests replayed while ``fault`` was injected, by outcome."""
        sent = sum(outcomes.values())
        with self._lock:
            self.fault_load[fault] = {"sent": sent, "answered": outcomes.get("ok", 0),
                                      "failed_clearly": sent - outcomes.get("ok", 0) - lost, "lost": lost}

    def concurrent_writes(self, vendor: str, operation: str, statuses: dict[int, int]) -> None:
        with self._lock:
            counts = self.concurrent_writes_by_db.setdefault(vendor, {}).setdefault(operation, {})
            for status, count in statuses.items():
                counts[status] = counts.get(status, 0) + count

    def load(self, *, outcomes: dict[str, int], lost: int, seconds: float) -> None:
        """Ranking requests replayed during the faults, by outcome (``harness.Outcome.kind``)."""
        with self._lock:
            requests = sum(outcomes.values())
            self.rank_requests += requests
            self.rank_ok += outcomes.get("ok", 0)
            self.rank_clear_errors += requests - outcomes.get("ok", 0) - lost
            self.requests_lost += lost
            self.load_seconds += seconds
            for kind, count in outcomes.items():
                self.rank_outcomes[kind] = self.rank_outcomes.get(kind, 0) + count

    def to_dict(self) -> dict:
        with self._lock:
            data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}
        data["load_requests_per_s"] = round(self.rank_requests / self.load_seconds, 2) if self.load_seconds else None
        data["hostile_inputs_total"] = sum(self.hostile_inputs.values())
        return data

    def lines(self) -> list[str]:
        d = self.to_dict()
        return [
            f"load held: {d['load_requests_per_s']} ranking requests/s replayed over {self.load_seconds:.0f} s "
            f"({self.rank_requests} requests: {self.rank_ok} ok, {self.rank_clear_errors} clear errors: "
            f"{ {k: v for k, v in sorted(self.rank_outcomes.items()) if k != 'ok'} })",
            f"faults injected: {len(self.faults_injected)}, survived: {len(self.faults_survived)} "
            f"({', '.join(self.faults_survived) or '-'})",
            f"hostile inputs tried: {d['hostile_inputs_total']} {dict(sorted(self.hostile_inputs.items()))}",
            f"requests lost: {self.requests_lost}",
            *(f"fault: {name}: {counts}" for name, counts in self.fault_load.items()),
            *(f"concurrent writes on {vendor}: {operation}: {dict(sorted(counts.items()))}"
              for vendor, operations in sorted(self.concurrent_writes_by_db.items())
              for operation, counts in operations.items()),
        ]

    def write(self) -> None:
        ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
        ARTIFACT.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


@dataclass
class FaultRecord:
    figures: Figures
    name: str

    def survived(self) -> None:
        with self.figures._lock:
            self.figures.faults_survived.append(self.name)


FIGURES = Figures()


def scaled(examples: int) -> int:
    """A fuzz test's example count times ``RELAYGR_FUZZ_SCALE`` (1 in the suite; larger for a long run)."""
    return max(1, round(examples * float(os.environ.get("RELAYGR_FUZZ_SCALE", "1"))))
