"""Per-head directions toward consistent outputs, and the policy's ``editing`` section built from them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from relay_engine.core.config import (
    EDIT_SCOPES,
    EditingConfig,
    HeadEdit,
    LowRankEdit,
    ModelFingerprint,
    parse_policy,
    to_plain,
)
from relay_engine.lab.editing.fitting import FittedMap
from relay_engine.lab.editing.probes import HeadProbe

METHODS = ("mean_shift", "iti")  # from probes: GR and LLM


def directions(activations: torch.Tensor, labels: torch.Tensor, heads: Sequence[HeadProbe],
               method: str = "iti") -> dict[tuple[int, int], torch.Tensor]:
    """Per head, the shift toward consistent samples: [D] each.

    ``mean_shift``: mean(consistent) − mean(all). ``iti``: that vector made unit length and scaled
    by the standard deviation of all activations projected on it, so α counts standard deviations.
    """
    if method not in METHODS:
        raise ValueError(f"method {method!r}: must be one of {', '.join(METHODS)}")
    consistent = labels.bool()
    if not consistent.any():
        raise ValueError("labels: no consistent sample, so there is no direction to move toward")
    out = {}
    for p in heads:
        acts = activations[:, p.layer, p.head].double()  # [n, D]
        shift = acts[consistent].mean(0) - acts.mean(0)
        if method == "iti":
            unit = shift / shift.norm().clamp_min(1e-12)
            shift = unit * (acts @ unit).std()
        out[(p.layer, p.head)] = shift.float()
    return out


def build_editing(fingerprint: ModelFingerprint, dirs: dict[tuple[int, int], torch.Tensor], alpha: float, *,
                  scope: str = "candidates", provenance: dict[str, Any] | None = None,
                  maps: Sequence[FittedMap] = ()) -> EditingConfig:
    """The ``editing`` section of a policy, validated by the same code the fleet runs: ``α · direction``
    on each head of ``dirs``, and each low-rank map of ``maps`` at weight α."""
    if scope not in EDIT_SCOPES:
        raise ValueError(f"scope {scope!r}: must be one of {', '.join(EDIT_SCOPES)}")
    edits = [HeadEdit(layer=li, head=hi, direction=tuple(float(v) for v in d.tolist()), alpha=float(alpha))
             for (li, hi), d in sorted(dirs.items())]
    lowrank = [LowRankEdit(layer=m.layer, heads=m.heads, rotation=_rows(m.rotation),
                           source_weight=_rows(m.source_weight),
                           source_bias=tuple(float(v) for v in m.source_bias.tolist()), alpha=float(alpha))
               for m in maps]
    draft = EditingConfig(fingerprint=fingerprint, edits=tuple(edits), scope=scope,
                          provenance={**(provenance or {}), "alpha": float(alpha)}, lowrank=tuple(lowrank))
    editing = parse_policy({"editing": to_plain(draft)}).editing
    assert editing is not None
    return editing


def _rows(matrix: torch.Tensor) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(float(v) for v in row) for row in matrix.tolist())
