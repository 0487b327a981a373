"""Edits fitted directly on equivalent pairs (GR only): constant head vectors ("fit") and input-dependent
low-rank maps of head outputs ("lowrank", LoReFT-style).

Both minimise, per user, ``KL(unedited(original) ‖ edited(original)) + w · mean_rewrites C`` over
the candidate scores: the first term keeps the ranking of the canonical history (quality), the
second pulls each rewrite's ranking onto the original's (consistency). C is one of ``FIT_LOSSES``:

* ``kl``: ``KL(edited(original) ‖ edited(rewrite))`` over softmaxes of the scores. Most of its mass
  is on the few best items, while top-10 identity is decided at the cut-off, where neighbouring
  scores differ by little (the trained model's median gap between ranks 10 and 11 is ~0.04, its
  rewrites move scores by ~0.03): it barely sees the swaps it should prevent.
* ``cutoff``: a pairwise logistic loss at the cut-off — in the rewrite, every item of the
  original's top-10 should outscore every item the original ranks 11–20:
  ``mean softplus(−(s_rew[i] − s_rew[j]) / τ)`` with τ = ``CUTOFF_TEMPERATURE``, on the scale of
  those gaps.

No next-item label is used, the model's weights are untouched, and the result has exactly the form
the fleet serves, so α = 1 is the fitted edit itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from relay_engine.core.model import EditTensors, HSTUModel, LowRankMap
from relay_engine.lab import consistency as cons
from relay_engine.lab.synthetic import INFORMATION_PRESERVING, SyntheticWorld

FIT_LOSSES = ("kl", "cutoff")
CUTOFF_TEMPERATURE = 0.05  # score units, about the trained model's median gap between ranks 10 and 11
CUTOFF_K = 10  # the cut-off: top-10 against ranks 11-20


@dataclass(frozen=True)
class FittedMap:
    """A fitted low-rank map of the outputs of ``heads`` in ``layer``: ``h + α·Rᵀ(W·h + b − R·h)``."""

    layer: int
    heads: tuple[int, ...]
    rotation: torch.Tensor  # R [rank, n·D], orthonormal rows
    source_weight: torch.Tensor  # W [rank, n·D]
    source_bias: torch.Tensor  # b [rank]

    @property
    def rank(self) -> int:
        return int(self.rotation.shape[0])


def fit_head_biases(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int], *, scope: str = "candidates",
                    kinds: Sequence[str] = INFORMATION_PRESERVING, loss: str = "kl", consistency_weight: float = 5.0,
                    epochs: int = 6, lr: float = 0.05, batch_users: int = 16, temperature: float = 1.0, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """Per-head bias vectors [D] for every head, fitted so that equivalent inputs (``kinds`` of
    rewrite) score alike: the same edit as a probe direction, a vector added to each head's output."""
    c = model.config
    bias = torch.zeros(c.num_layers, c.num_heads, c.head_dim, device=model.device, requires_grad=True)

    def edit() -> EditTensors:
        return EditTensors(tuple(bias[li] for li in range(c.num_layers)), ((),) * c.num_layers, scope, "fitting")

    _fit_pairs(model, world, user_ids, [bias], edit, kinds=kinds, loss=loss, consistency_weight=consistency_weight,
               epochs=epochs, lr=lr, batch_users=batch_users, temperature=temperature, seed=seed, log=log)
    fitted = bias.detach().cpu()
    return {(li, hi): fitted[li, hi].clone() for li in range(c.num_layers) for hi in range(c.num_heads)}


def fit_lowrank_maps(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int], *, rank: int = 8,
                     layers: Sequence[int] | None = None, scope: str = "candidates",
                     kinds: Sequence[str] = INFORMATION_PRESERVING, loss: str = "cutoff",
                     consistency_weight: float = 0.2, epochs: int = 6, lr: float = 0.05, batch_users: int = 16,
                     temperature: float = 1.0, seed: int = 0,
                     log: Callable[[str], None] | None = None) -> list[FittedMap]:
    """One rank-``rank`` map per layer (all by default) over all of its heads, fitted on equivalent pairs.

    R = Qᵀ of a QR factorisation (orthonormal rows throughout), W = R + ΔW; ΔW and b start at zero,
    so the fit starts from the unedited model (the edit is ``α·Rᵀ(ΔW·h + b)``)."""
    c = model.config
    width = c.num_heads * c.head_dim
    if not 1 <= rank <= width:
        raise ValueError(f"rank {rank}: must be in [1, {width}] (num_heads · head_dim)")
    layers = list(range(c.num_layers)) if layers is None else sorted(set(layers))
    if not layers or not all(0 <= li < c.num_layers for li in layers):
        raise ValueError(f"layers {layers}: must be a non-empty subset of 0…{c.num_layers - 1}")
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(len(layers), width, rank, generator=g).to(model.device).requires_grad_(True)
    shift = torch.zeros(len(layers), rank, width, device=model.device, requires_grad=True)  # ΔW
    bias = torch.zeros(len(layers), rank, device=model.device, requires_grad=True)  # b
    heads = torch.arange(c.num_heads, device=model.device)

    def rotations() -> torch.Tensor:
        return torch.linalg.qr(basis).Q.transpose(1, 2)  # [layers, rank, width]

    def edit() -> EditTensors:
        r = rotations()
        maps: list[tuple[LowRankMap, ...]] = [() for _ in range(c.num_layers)]
        for i, li in enumerate(layers):
            maps[li] = (LowRankMap.from_parts(heads, r[i], r[i] + shift[i], bias[i]),)
        return EditTensors((None,) * c.num_layers, tuple(maps), scope, "fitting")

    _fit_pairs(model, world, user_ids, [basis, shift, bias], edit, kinds=kinds, loss=loss,
               consistency_weight=consistency_weight, epochs=epochs, lr=lr, batch_users=batch_users,
               temperature=temperature, seed=seed, log=log)
    with torch.no_grad():
        r = rotations().cpu()
        return [FittedMap(li, tuple(range(c.num_heads)), r[i].clone(), (r[i] + shift[i].cpu()).clone(),
                          bias[i].detach().cpu().clone()) for i, li in enumerate(layers)]


def cutoff_loss(original: torch.Tensor, rewritten: torch.Tensor) -> torch.Tensor:
    """Scores [C] → ``mean softplus(−(s_rew[i] − s_rew[j]) / τ)`` over i in the original's top-10 and j in
    its ranks 11–20 (the original's ranking is a constant here, not differentiated)."""
    ranking = torch.argsort(original.detach(), descending=True)
    top, below = ranking[:CUTOFF_K], ranking[CUTOFF_K:2 * CUTOFF_K]
    return F.softplus((rewritten[below][None, :] - rewritten[top][:, None]) / CUTOFF_TEMPERATURE).mean()


def _fit_pairs(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int], params: list[torch.Tensor],
               edit: Callable[[], EditTensors], *, kinds: Sequence[str], loss: str, consistency_weight: float,
               epochs: int, lr: float, batch_users: int, temperature: float, seed: int,
               log: Callable[[str], None] | None) -> None:
    """Adam on ``params`` (through ``edit()``, rebuilt per user so it tracks them) over the users' pairs."""
    if loss not in FIT_LOSSES:
        raise ValueError(f"loss {loss!r}: must be one of {', '.join(FIT_LOSSES)}")
    candidates = world.candidates().to(model.device)
    no_edit = model.no_edit()
    by_user: dict[int, list[cons.EquivalentPair]] = {}
    for pair in cons.equivalent_pairs(world, user_ids, kinds):
        by_user.setdefault(pair.user_id, []).append(pair)
    if not by_user:
        raise ValueError("no equivalent pairs to fit on: give users and at least one kind of rewrite")

    def scores(history: Any, e: EditTensors) -> torch.Tensor:
        return model.forward(history.to_history(), candidates, edit=e)[1]  # [C]

    def consistency_loss(original: torch.Tensor, rewritten: torch.Tensor) -> torch.Tensor:
        if loss == "kl":
            return F.kl_div(torch.log_softmax(rewritten / temperature, -1), torch.log_softmax(original / temperature, -1),
                            log_target=True, reduction="sum")
        return cutoff_loss(original, rewritten)

    with torch.no_grad():
        reference = {u: torch.log_softmax(scores(pairs[0].original, no_edit) / temperature, -1)
                     for u, pairs in by_user.items()}
    optimizer = torch.optim.Adam(params, lr=lr)
    users = np.asarray(sorted(by_user))
    for epoch in range(epochs):
        order = np.random.default_rng([seed, 4, epoch]).permutation(users)
        total_q = total_c = 0.0
        for b in range(0, len(order), batch_users):
            optimizer.zero_grad(set_to_none=True)
            batch = order[b:b + batch_users]
            for uid in batch:
                e = edit()
                pairs = by_user[int(uid)]
                original = scores(pairs[0].original, e)
                loss_q = F.kl_div(torch.log_softmax(original / temperature, -1), reference[int(uid)],
                                  log_target=True, reduction="sum")
                loss_c = sum(consistency_loss(original, scores(p.rewritten, e)) for p in pairs) / len(pairs)
                ((loss_q + consistency_weight * loss_c) / len(batch)).backward()
                total_q += float(loss_q.detach())
                total_c += float(loss_c.detach())
            optimizer.step()
        if log is not None:
            log(f"fit epoch {epoch + 1}/{epochs}: KL to unedited {total_q / len(users):.4f}, "
                f"{loss} loss between equivalent inputs {total_c / len(users):.4f}")
