"""Head vectors fitted directly on equivalent pairs (GR only): the "fit" method."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from relay_engine.core.model import HeadBias, HSTUModel
from relay_engine.lab import consistency as cons
from relay_engine.lab.synthetic import SyntheticWorld


def fit_head_biases(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int], *, scope: str = "candidates",
                    consistency_weight: float = 5.0, epochs: int = 6, lr: float = 0.05, batch_users: int = 16,
                    temperature: float = 1.0, seed: int = 0, log: Callable[[str], None] | None = None) -> dict[tuple[int, int], torch.Tensor]:
    """Per-head bias vectors [D] for every head, fitted so that equivalent inputs score alike.

    The edit has exactly the form the fleet serves (a vector added to each head's output, ``scope``
    rows), so α = 1 is the fitted edit itself. Per user, the loss is
    ``KL(unedited(original) ‖ edited(original)) + w · mean_rewrites KL(edited(original) ‖ edited(rewrite))``
    over softmaxes of the candidate scores: the first term keeps the ranking of the canonical history
    (quality), the second pulls each rewrite's ranking onto it (consistency). No next-item label is used.
    """
    c = model.config
    candidates = world.candidates().to(model.device)
    no_edit = model.no_edit()
    by_user: dict[int, list[cons.EquivalentPair]] = {}
    for pair in cons.equivalent_pairs(world, user_ids):
        by_user.setdefault(pair.user_id, []).append(pair)

    def scores(history: Any, edit: HeadBias) -> torch.Tensor:
        _, s = model.forward(history.to_history(), candidates, edit=edit)
        return torch.log_softmax(s / temperature, -1)

    with torch.no_grad():
        reference = {u: scores(pairs[0].original, no_edit) for u, pairs in by_user.items()}
    bias = torch.zeros(c.num_layers, c.num_heads, c.head_dim, device=model.device, requires_grad=True)
    optimizer = torch.optim.Adam([bias], lr=lr)
    users = np.asarray(sorted(by_user))
    for epoch in range(epochs):
        order = np.random.default_rng([seed, 4, epoch]).permutation(users)
        total_q = total_c = 0.0
        for b in range(0, len(order), batch_users):
            optimizer.zero_grad(set_to_none=True)
            batch = order[b:b + batch_users]
            for uid in batch:
                edit = HeadBias(tuple(bias[li] for li in range(c.num_layers)), scope, "fitting")
                pairs = by_user[int(uid)]
                original = scores(pairs[0].original, edit)
                loss_q = torch.nn.functional.kl_div(original, reference[int(uid)], log_target=True, reduction="sum")
                loss_c = sum(torch.nn.functional.kl_div(scores(p.rewritten, edit), original, log_target=True,
                                                        reduction="sum") for p in pairs) / len(pairs)
                ((loss_q + consistency_weight * loss_c) / len(batch)).backward()
                total_q += float(loss_q.detach())
                total_c += float(loss_c.detach())
            optimizer.step()
        if log is not None:
            log(f"fit epoch {epoch + 1}/{epochs}: KL to unedited {total_q / len(users):.4f}, "
                f"KL between equivalent inputs {total_c / len(users):.4f}")
    fitted = bias.detach().cpu()
    return {(li, hi): fitted[li, hi].clone() for li in range(c.num_layers) for hi in range(c.num_heads)}
