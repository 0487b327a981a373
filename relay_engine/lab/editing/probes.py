"""Probing: which heads carry the consistency label, judged on held-out groups."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class HeadProbe:
    layer: int
    head: int
    val_accuracy: float
    train_accuracy: float


def split_by_group(groups: np.ndarray, val_fraction: float = 0.4, seed: int = 0) -> np.ndarray:
    """Boolean mask [n] of held-out samples; whole groups (users, items) go to one side, so no
    near-duplicate of a training sample is ever scored as held out."""
    unique = np.unique(groups)
    held = np.random.default_rng(seed).permutation(unique)[: max(1, int(round(len(unique) * val_fraction)))]
    return np.isin(groups, held)


def fit_probes(activations: torch.Tensor, labels: torch.Tensor, val_mask: torch.Tensor, *, steps: int = 200,
               weight_decay: float = 1e-2) -> tuple[torch.Tensor, torch.Tensor]:
    """Logistic regression per head, all heads at once. activations: [n, L, H, D]; labels: [n] in {0, 1}.

    Returns (train accuracy [L, H], held-out accuracy [L, H]). Features are standardised with the
    training split's statistics; full-batch L-BFGS with an L2 penalty.
    """
    n, n_layers, n_heads, d = activations.shape
    x = activations.reshape(n, n_layers * n_heads, d).double().transpose(0, 1)  # [LH, n, D]
    y = labels.double()
    tr, va = ~val_mask, val_mask
    mu = x[:, tr].mean(1, keepdim=True)
    sd = x[:, tr].std(1, keepdim=True).clamp_min(1e-6)
    x = (x - mu) / sd
    w = torch.zeros(n_layers * n_heads, d, 1, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(n_layers * n_heads, 1, 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")
    y_tr = y[tr].expand(n_layers * n_heads, -1)  # [LH, n_tr]

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = (torch.bmm(x[:, tr], w) + b).squeeze(-1)  # [LH, n_tr]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y_tr, reduction="none").mean(1).sum()
        loss = loss + weight_decay * (w**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        pred = ((torch.bmm(x, w) + b).squeeze(-1) > 0).double()  # [LH, n]
        correct = (pred == y).double()
        train_acc = correct[:, tr].mean(1).reshape(n_layers, n_heads)
        val_acc = correct[:, va].mean(1).reshape(n_layers, n_heads)
    return train_acc.float(), val_acc.float()


def locate_heads(activations: torch.Tensor, labels: torch.Tensor, val_mask: torch.Tensor, k: int
                 ) -> tuple[list[HeadProbe], list[HeadProbe]]:
    """Probe every head; return (top-k heads by held-out accuracy, all heads), best first.

    Ties in held-out accuracy are broken by training accuracy, then by (layer, head)."""
    train_acc, val_acc = fit_probes(activations, labels, val_mask)
    n_layers, n_heads = val_acc.shape
    probes = [HeadProbe(li, hi, float(val_acc[li, hi]), float(train_acc[li, hi]))
              for li in range(n_layers) for hi in range(n_heads)]
    probes.sort(key=lambda p: (-p.val_accuracy, -p.train_accuracy, p.layer, p.head))
    return probes[:k], probes


def digest(*chunks: bytes) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(len(c).to_bytes(8, "little"))
        h.update(c)
    return h.hexdigest()


def probe_provenance(*, method: str, k: int, dataset_hash: str, samples: int, consistent_share: float,
                     heads: Sequence[HeadProbe], **extra: Any) -> dict[str, Any]:
    return {
        "method": method,
        "k": k,
        "dataset_hash": dataset_hash,
        "samples": samples,
        "consistent_share": round(consistent_share, 4),
        "probe_accuracies": [{"layer": p.layer, "head": p.head, "val_accuracy": round(p.val_accuracy, 4),
                              "train_accuracy": round(p.train_accuracy, 4)} for p in heads],
        **extra,
    }
