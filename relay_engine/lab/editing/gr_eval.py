"""The editing workflow on the synthetic GR model: probe data, the (K, α) sweep on validation users,
one measurement on test users, the plot and the written configuration."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relay_engine.core.config import EditingConfig
from relay_engine.core.editing_io import editing_json, write_editing_npz
from relay_engine.core.model import HSTUModel
from relay_engine.lab import consistency as cons
from relay_engine.lab.editing.directions import METHODS, build_editing, directions
from relay_engine.lab.editing.fitting import fit_head_biases
from relay_engine.lab.editing.probes import HeadProbe, digest, locate_heads, probe_provenance, split_by_group
from relay_engine.lab.synthetic import SyntheticWorld, WorldConfig, train, world_digest

GR_METHODS = METHODS + ("fit",)  # "fit": vectors fitted on equivalent pairs (GR only)


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
    no_edit = model.no_edit()
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
        edit = model.edit_from(editing)
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
    edit = model.edit_from(editing) if best.k else None
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
    write_editing_npz(editing, out / "gr_editing.npz")
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
