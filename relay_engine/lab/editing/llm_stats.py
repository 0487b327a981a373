"""Statistics of the real-LM test: accuracy per instruction, its spread, agreement, and how sure we are.

Everything works on choice grids [instructions, items] (the option each instruction's prompt chose
for each item) and the items' labels; numpy only, so it is tested without the optional extra.

* ``score_answers``: accuracy per instruction, its mean and std across instructions, and the share
  of items answered alike under every instruction (agreement).
* ``bootstrap``: 95 % intervals over items — of each measure of one grid, and of the change
  between two grids of the same items (paired: both are scored on the same resample).
* ``noise_floor``: the std across m instructions that binomial sampling of n items alone gives
  when every instruction has the same accuracy — the spread below which no change can be seen.
* ``choose_setting``: the selection rule, which may keep the unedited model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, TypeVar

import numpy as np

MEASURES = ("mean", "std", "agreement")
Z95 = NormalDist().inv_cdf(0.975)
Z80 = NormalDist().inv_cdf(0.80)
Key = TypeVar("Key")


@dataclass(frozen=True)
class LLMScore:
    accuracy_by_instruction: list[float]
    agreement: float  # share of items answered the same under every instruction

    @property
    def mean(self) -> float:
        return float(np.mean(self.accuracy_by_instruction))

    @property
    def std(self) -> float:
        return float(np.std(self.accuracy_by_instruction))

    def to_dict(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "agreement": self.agreement,
                "by_instruction": self.accuracy_by_instruction}


def score_answers(grid: np.ndarray, labels: np.ndarray) -> LLMScore:
    """Accuracy per instruction and agreement of a grid of choices [instructions, items]."""
    acc = (grid == labels[None, :]).mean(1)
    same = (grid == grid[:1]).all(0).mean()
    return LLMScore([float(a) for a in acc], float(same))


def _measures(right: np.ndarray, same: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """[mean, std, agreement] of a resample: right [instructions, items] bool, same [items] bool."""
    acc = right[:, idx].mean(1)
    return np.array([acc.mean(), acc.std(), same[idx].mean()])


def bootstrap(before: np.ndarray, after: np.ndarray, labels: np.ndarray, *, samples: int = 2000,
              seed: int = 0) -> dict[str, Any]:
    """95 % intervals over items: of the change in accuracy mean, std and agreement (after − before,
    both grids scored on the same resample), and of each measure of either grid; plus the standard
    error of each change (the bootstrap's std), which gives the test's power."""
    g = np.random.default_rng(seed)
    n = labels.shape[0]
    grids = {"before": before, "after": after}
    right = {k: v == labels[None, :] for k, v in grids.items()}
    same = {k: (v == v[:1]).all(0) for k, v in grids.items()}
    draws = {k: np.empty((samples, 3)) for k in grids}
    for i in range(samples):
        idx = g.integers(0, n, n)
        for k in grids:
            draws[k][i] = _measures(right[k], same[k], idx)
    change = draws["after"] - draws["before"]
    out: dict[str, Any] = {}
    for j, m in enumerate(MEASURES):
        out[f"{m}_change_95"] = _interval(change[:, j])
        out[f"{m}_change_se"] = float(change[:, j].std())
        for k in grids:
            out.setdefault(k, {})[f"{m}_95"] = _interval(draws[k][:, j])
    return out


def paired_bootstrap(before: np.ndarray, after: np.ndarray, labels: np.ndarray, *, samples: int = 2000,
                     seed: int = 0) -> dict[str, list[float]]:
    """The change intervals alone: ``mean_change_95``, ``std_change_95``, ``agreement_change_95``."""
    full = bootstrap(before, after, labels, samples=samples, seed=seed)
    return {f"{m}_change_95": full[f"{m}_change_95"] for m in MEASURES}


def noise_floor(accuracy: float, items: int, instructions: int, *, samples: int = 20_000,
                seed: int = 0) -> dict[str, float]:
    """The std across ``instructions`` accuracies that sampling ``items`` items alone gives when every
    instruction's true accuracy is ``accuracy``: its mean and 95 % range (simulated binomials).

    An observed spread at this level is what identical instructions would show; a smaller one
    cannot be told apart from it on this many items."""
    g = np.random.default_rng(seed)
    stds = (g.binomial(items, accuracy, size=(samples, instructions)) / items).std(1)
    return {"mean": float(stds.mean()), "low_95": float(np.percentile(stds, 2.5)),
            "high_95": float(np.percentile(stds, 97.5)),
            "binomial_se_per_instruction": float(np.sqrt(accuracy * (1 - accuracy) / items))}


def power(effect: float, se: float) -> float:
    """Chance that a two-sided 5 % test sees a change of size ``effect`` when its estimate has standard error ``se``."""
    if se <= 0:
        return 1.0 if effect else 0.0
    return float(NormalDist().cdf(abs(effect) / se - Z95))


def detectable_change(se: float) -> float:
    """The smallest change a two-sided 5 % test sees with 80 % power, for an estimate of standard error ``se``."""
    return float((Z95 + Z80) * se)


def choose_setting(grids: Mapping[Key, np.ndarray], labels: np.ndarray, unedited: Key, *, samples: int = 1000,
                   seed: int = 0) -> tuple[Key, dict[Key, dict[str, Any]]]:
    """The selection rule, on the selection items only: the edit with the smallest std across
    instructions among those whose accuracy is not below the unedited model's and whose std is
    lower than the unedited model's by more than chance (the upper end of the paired 95 % interval
    of the std change is below 0). None qualifies → the unedited model is kept.

    Returns the choice and, per setting, why (its score, the std change interval, eligibility)."""
    base = score_answers(grids[unedited], labels)
    report: dict[Key, dict[str, Any]] = {}
    eligible = []
    for key, grid in grids.items():
        s = score_answers(grid, labels)
        if key == unedited:
            report[key] = {"score": s.to_dict(), "eligible": True, "reason": "the unedited model"}
            continue
        change = paired_bootstrap(grids[unedited], grid, labels, samples=samples, seed=seed)["std_change_95"]
        if s.mean < base.mean:
            reason = "accuracy below the unedited model's"
        elif change[1] >= 0:
            reason = "std not lower than the unedited model's beyond chance"
        else:
            reason = "eligible"
            eligible.append((s.std, -s.mean, key))
        report[key] = {"score": s.to_dict(), "std_change_95": change, "eligible": reason == "eligible",
                       "reason": reason}
    if not eligible:
        return unedited, report
    return min(eligible, key=lambda e: (e[0], e[1]))[2], report


def _interval(values: np.ndarray) -> list[float]:
    return [float(v) for v in np.percentile(values, [2.5, 97.5])]
