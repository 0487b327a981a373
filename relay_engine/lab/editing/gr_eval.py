"""The editing workflow on the synthetic GR model: build the candidate edits (probe directions, fitted
head vectors or fitted low-rank maps), sweep them on validation users, measure the one chosen there
once on test users — for each seed of the base model — and report per rewrite, with paired intervals.

Aliases are reported apart from the rewrites that keep every id (``INFORMATION_PRESERVING``): they
are id canonicalisation, measured separately with ``AliasMap`` applied to the features.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relay_engine.core.config import EditingConfig
from relay_engine.core.editing_io import editing_json, write_editing_npz
from relay_engine.core.features import AliasMap, Canonical, Canonicaliser, EventDedup
from relay_engine.core.model import HSTUModel
from relay_engine.lab import consistency as cons
from relay_engine.lab.editing.directions import METHODS, build_editing, directions
from relay_engine.lab.editing.fitting import fit_head_biases, fit_lowrank_maps
from relay_engine.lab.editing.probes import HeadProbe, digest, locate_heads, probe_provenance, split_by_group
from relay_engine.lab.synthetic import (
    INFORMATION_PRESERVING,
    REWRITES,
    SyntheticWorld,
    WorldConfig,
    train,
    world_digest,
)

GR_METHODS = METHODS + ("fit", "lowrank")  # fitted on equivalent pairs (GR only): head vectors, low-rank maps
# A duplicate the log wrote is one second after its original at most (synthetic.py's rewrite; the log's own
# repeats share the timestamp).
DUPLICATE_TOLERANCE_S = 1.0
MAX_NDCG_DROP = 0.01  # the choice keeps NDCG@10 within 1 % of the unedited model on validation


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
    """One setting measured: consistency overall, on the rewrites that keep every id, and per rewrite;
    quality on other users' next items. K = 0 is the unedited model."""

    k: int  # heads edited
    alpha: float
    top10_same: float
    top10_overlap: float
    kendall_tau: float
    ndcg10: float
    hr10: float
    rank: int = 0  # of the low-rank maps (lowrank only)
    weight: float = 0.0  # the fit's consistency weight (fit, lowrank)
    top10_rbo: float = 0.0
    non_alias_top10_same: float = 0.0
    top10_same_by_rewrite: dict[str, float] = field(default_factory=dict)
    top10_overlap_by_rewrite: dict[str, float] = field(default_factory=dict)
    top10_rbo_by_rewrite: dict[str, float] = field(default_factory=dict)

    @property
    def setting(self) -> tuple[int, int, float, float]:
        return self.k, self.rank, self.weight, self.alpha


def measure(model: HSTUModel, world: SyntheticWorld, pairs: Sequence[cons.EquivalentPair],
            quality_users: Sequence[int], editing: EditingConfig | None, *, k: int = 0, alpha: float = 0.0,
            rank: int = 0, weight: float = 0.0) -> tuple[SweepRow, cons.Consistency, cons.Quality]:
    edit = model.edit_from(editing)
    c = cons.consistency(model, world, pairs, edit)
    q = cons.quality(model, world, quality_users, edit)
    row = SweepRow(k, alpha, c.top10_same, c.top10_overlap, c.kendall_tau, q.ndcg10, q.hr10, rank, weight,
                   c.top10_rbo, c.same_share(INFORMATION_PRESERVING), c.by_kind, c.overlap_by_kind, c.rbo_by_kind)
    return row, c, q


def _format_header() -> str:
    kinds = " ".join(f"{k[:8]:>8}" for k in REWRITES)
    return (f"{'K':>3} {'rank':>4} {'w':>5} {'alpha':>6} {'same':>6} {'non-alias':>9} {'overlap':>7} {'rbo':>6} "
            f"{'NDCG@10':>8} {'HR@10':>6}  top10_same: {kinds}")


def _format_row(r: SweepRow) -> str:
    kinds = " ".join(f"{r.top10_same_by_rewrite.get(k, float('nan')):>8.3f}" for k in REWRITES)
    return (f"{r.k:>3} {r.rank:>4} {r.weight:>5g} {r.alpha:>6.2f} {r.top10_same:>6.3f} {r.non_alias_top10_same:>9.3f} "
            f"{r.top10_overlap:>7.3f} {r.top10_rbo:>6.3f} {r.ndcg10:>8.4f} {r.hr10:>6.3f}  {'':>11} {kinds}")


def best_row(rows: Sequence[SweepRow], max_ndcg_drop: float = MAX_NDCG_DROP) -> SweepRow:
    """The setting most consistent on the rewrites that keep every id whose NDCG@10 is at most
    ``max_ndcg_drop`` (relative) below baseline (rows[0]); the baseline itself when none is better."""
    base = rows[0]
    ok = [r for r in rows if r.ndcg10 >= base.ndcg10 * (1 - max_ndcg_drop)]
    best = max(ok, key=lambda r: (r.non_alias_top10_same, r.ndcg10))
    return best if best.non_alias_top10_same > base.non_alias_top10_same else base


def degradation_alphas(rows: Sequence[SweepRow], max_ndcg_drop: float = MAX_NDCG_DROP) -> dict[str, float | None]:
    """Per edit family (K, rank, w), the smallest α whose NDCG@10 falls more than ``max_ndcg_drop`` below baseline."""
    base = rows[0]
    out: dict[str, float | None] = {}
    for r in rows[1:]:
        name = _family(r)
        out.setdefault(name, None)
        if out[name] is None and r.ndcg10 < base.ndcg10 * (1 - max_ndcg_drop):
            out[name] = r.alpha
    return out


def _family(r: SweepRow) -> str:
    return f"rank={r.rank} w={r.weight:g}" if r.rank else (f"K={r.k} w={r.weight:g}" if r.weight else f"K={r.k}")


def mean_rows(rows: Sequence[SweepRow]) -> SweepRow:
    """Metrics averaged over seeds; the setting is kept where every seed has the same one (else -1)."""
    first = rows[0]
    same = all(r.setting == first.setting for r in rows)
    metrics = {name: float(np.mean([getattr(r, name) for r in rows]))
               for name in ("top10_same", "top10_overlap", "kendall_tau", "ndcg10", "hr10", "top10_rbo",
                            "non_alias_top10_same")}
    by = {name: {k: float(np.mean([getattr(r, name)[k] for r in rows])) for k in getattr(first, name)}
          for name in ("top10_same_by_rewrite", "top10_overlap_by_rewrite", "top10_rbo_by_rewrite")}
    setting = {} if same else {"k": -1, "rank": -1, "weight": -1.0, "alpha": -1.0}
    return replace(first, **metrics, **by, **setting)


def plot_sweep(rows: Sequence[SweepRow], path: Path, title: str) -> Path:
    """Against α, one line per edit family: top-10 consistency per rewrite and on the id-keeping ones, and NDCG@10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = rows[0]
    panels = [(f"{k}" + ("" if k in INFORMATION_PRESERVING else " (ids change: canonicalisation)"),
               lambda r, k=k: 100 * r.top10_same_by_rewrite[k]) for k in REWRITES]
    panels.append(("reorder + duplicate + time_shift", lambda r: 100 * r.non_alias_top10_same))
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5))
    families = sorted({_family(r) for r in rows[1:]})
    for ax, (name, value) in zip(axes.flat, panels, strict=False):
        for fam in families:
            sel = [base] + [r for r in rows[1:] if _family(r) == fam]
            ax.plot([r.alpha for r in sel], [value(r) for r in sel], marker="o", label=fam)
        ax.set(xlabel="α (1 = the fitted edit)", ylabel="pairs with the same top-10 (%)", title=name)
    ax_q = axes.flat[-1]
    for fam in families:
        sel = [base] + [r for r in rows[1:] if _family(r) == fam]
        ax_q.plot([r.alpha for r in sel], [r.ndcg10 for r in sel], marker="o", label=fam)
    ax_q.axhline(base.ndcg10 * (1 - MAX_NDCG_DROP), color="grey", linestyle="--", linewidth=1, label="baseline − 1 %")
    ax_q.set(xlabel="α", ylabel="NDCG@10", title="quality (held-out next items)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    ax_q.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Users:
    """Disjoint user ranges: what fits the edits, chooses among them, and measures the choice."""

    probe: range
    fit: range
    validation: range
    validation_quality: range
    test: range
    test_quality: range

    @classmethod
    def of(cls, args: argparse.Namespace) -> Users:
        return cls(probe=range(1_000_000, 1_000_000 + args.probe_users),
                   fit=range(1_000_000, 1_000_000 + args.fit_users),
                   validation=range(2_000_000, 2_000_000 + args.eval_users),
                   validation_quality=range(3_000_000, 3_000_000 + args.quality_users),
                   test=range(4_000_000, 4_000_000 + args.test_users),
                   test_quality=range(5_000_000, 5_000_000 + args.quality_users))


@dataclass
class Candidate:
    """One edit of the sweep and the provenance it is written with."""

    editing: EditingConfig | None
    k: int
    alpha: float
    rank: int = 0
    weight: float = 0.0


class DiskCache:
    """A JSON file of results by key, written after every new entry: an interrupted run resumes."""

    def __init__(self, path: Path):
        self.path = path
        self.data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    def get_or(self, key: str, compute: Callable[[], Any]) -> Any:
        if key not in self.data:
            self.data[key] = compute()
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)
        return self.data[key]


def trained_model(world: SyntheticWorld, model_seed: int, args: argparse.Namespace, out: Path,
                  log: Callable[[str], None]) -> tuple[HSTUModel, str]:
    """The base model of one seed, trained once and cached under ``out`` (its key names the checkpoint)."""
    model = HSTUModel(world.model_config(seed=model_seed))
    run_key = digest(world_digest(world).encode(), model.version.encode(),
                     repr((args.train_users, args.train_seconds, args.epochs)).encode())[:16]
    checkpoint = out / f"gr_model-{run_key}.pt"
    if checkpoint.exists() and not args.retrain:
        model.load_state_dict(torch.load(checkpoint))
        log(f"seed {model_seed}: loaded the trained model from {checkpoint}")
    else:
        cap = f" (at most {args.train_seconds:g}s)" if args.train_seconds else ""
        log(f"seed {model_seed}: training on {args.train_users} synthetic users{cap} …")
        report = train(model, world, users=range(args.train_users), epochs=args.epochs,
                       max_seconds=args.train_seconds, log=log)
        log(f"trained: {report.users} users, {report.steps} steps, {report.seconds:.0f}s, loss {report.final_loss:.3f}")
        torch.save(model.state_dict(), checkpoint)
    return model, run_key


def candidate_edits(model: HSTUModel, world: SyntheticWorld, users: Users, args: argparse.Namespace,
                    model_key: str, out: Path, log: Callable[[str], None]) -> list[Candidate]:
    """Every edit the validation sweep compares, for ``args.method``; fits are cached under ``out``."""
    fp = model.config.fingerprint()
    n_heads = model.config.num_layers * model.config.num_heads
    kinds = tuple(args.fit_rewrites)
    base_prov = {"method": args.method, "model_version": model.version,
                 "dataset": f"synthetic-gr world={world_digest(world)}"}
    if args.method == "lowrank":
        out_edits = []
        for rank in args.ranks:
            for weight in args.fit_weights:
                key = digest(model_key.encode(), repr(("lowrank", rank, weight, args.fit_loss, args.fit_epochs,
                                                       args.fit_lr, kinds, users.fit, args.layers, args.scope,
                                                       args.seed)).encode())[:16]
                maps = _cached_fit(out / f"fit-{key}.pt", lambda rank=rank, weight=weight: fit_lowrank_maps(
                    model, world, users.fit, rank=rank, layers=args.layers, scope=args.scope, kinds=kinds,
                    loss=args.fit_loss, consistency_weight=weight, epochs=args.fit_epochs, lr=args.fit_lr,
                    seed=args.seed, log=log), log, f"rank {rank}, w {weight:g}")
                prov = {**base_prov, "fit": {"users": len(users.fit), "epochs": args.fit_epochs, "rank": rank,
                                             "loss": args.fit_loss, "consistency_weight": weight,
                                             "rewrites": list(kinds), "lr": args.fit_lr}}
                for alpha in args.alphas:
                    editing = build_editing(fp, {}, alpha, scope=args.scope, provenance=prov, maps=maps)
                    heads = sum(len(m.heads) for m in maps)
                    out_edits.append(Candidate(editing, heads, alpha, rank, weight))
        return out_edits

    data = gr_probe_data(model, world, users.probe)
    val_mask = torch.from_numpy(split_by_group(data.groups, seed=args.seed))
    ks = args.ks or ([n_heads] if args.method == "fit" else [2, 4, 8])
    k_max = min(max(ks), n_heads)
    top, all_probes = locate_heads(data.activations, data.labels, val_mask, k_max)
    share = float(data.labels.mean())
    log(f"probe data: {len(data.labels)} pairs, {100 * share:.1f}% consistent; majority baseline "
        f"{max(share, 1 - share):.3f}; heads by held-out probe accuracy: "
        + ", ".join(f"L{p.layer}H{p.head}={p.val_accuracy:.3f}" for p in all_probes[:8]) + ", …")

    def provenance(k: int, heads: Sequence[HeadProbe], **extra: Any) -> dict[str, Any]:
        return probe_provenance(method=args.method, k=k, dataset_hash=data.dataset_hash, samples=len(data.labels),
                                consistent_share=share, heads=heads[:k], model_version=model.version,
                                dataset=base_prov["dataset"] + f" users={len(users.probe)}", **extra)

    families: list[tuple[float, dict[tuple[int, int], torch.Tensor], list[HeadProbe], dict[str, Any]]] = []
    if args.method == "fit":
        for weight in args.fit_weights:
            key = digest(model_key.encode(), repr(("fit", weight, args.fit_loss, args.fit_epochs, kinds, users.fit,
                                                   args.scope, args.seed)).encode())[:16]
            dirs = _cached_fit(out / f"fit-{key}.pt", lambda weight=weight: fit_head_biases(
                model, world, users.fit, scope=args.scope, kinds=kinds, loss=args.fit_loss,
                consistency_weight=weight, epochs=args.fit_epochs, seed=args.seed, log=log), log, f"w {weight:g}")
            # K keeps the heads whose fitted vectors are largest; the probes stay in the provenance.
            by_norm = sorted(all_probes, key=lambda p: (-float(dirs[(p.layer, p.head)].norm()), p.layer, p.head))
            families.append((weight, dirs, by_norm, {"fit": {"users": len(users.fit), "epochs": args.fit_epochs,
                                                             "loss": args.fit_loss, "consistency_weight": weight,
                                                             "rewrites": list(kinds)}}))
    else:
        dirs = directions(data.activations[~val_mask], data.labels[~val_mask], top, args.method)
        families.append((0.0, dirs, top, {}))
    out_edits = []
    for weight, dirs, order, extra in families:
        for k in ks:
            kept = {(p.layer, p.head): dirs[(p.layer, p.head)] for p in order[:k]}
            for alpha in args.alphas:
                editing = build_editing(fp, kept, alpha, scope=args.scope, provenance=provenance(k, order, **extra))
                out_edits.append(Candidate(editing, min(k, n_heads), alpha, 0, weight))
    return out_edits


def _cached_fit(path: Path, fit: Callable[[], Any], log: Callable[[str], None], what: str) -> Any:
    if path.exists():
        log(f"fit ({what}): loaded from {path}")
        return torch.load(path, weights_only=False)
    t0 = time.monotonic()
    log(f"fit ({what}) …")
    fitted = fit()
    torch.save(fitted, path)
    log(f"fit ({what}): {time.monotonic() - t0:.0f}s")
    return fitted


@dataclass
class SeedResult:
    seed: int
    rows: list[SweepRow]
    best: SweepRow
    editing: EditingConfig | None
    test_before: tuple[SweepRow, cons.Consistency, cons.Quality]
    test_after: tuple[SweepRow, cons.Consistency, cons.Quality]
    alias: dict[str, Any]
    duplicates: dict[str, Any]
    alias_and_duplicates: dict[str, Any]


def run_seed(model_seed: int, world: SyntheticWorld, users: Users, args: argparse.Namespace, out: Path,
             log: Callable[[str], None]) -> SeedResult:
    model, model_key = trained_model(world, model_seed, args, out, log)
    edits = candidate_edits(model, world, users, args, model_key, out, log)
    pairs = cons.equivalent_pairs(world, users.validation)
    rows_cache = DiskCache(out / f"gr_rows-{model_key}.json")
    log(f"seed {model_seed}: validation sweep of {len(edits)} edits on {len(pairs)} equivalent pairs of "
        f"{len(users.validation)} users, NDCG/HR on the next items of {len(users.validation_quality)} other users")
    log(_format_header())

    def validation_row(cand: Candidate | None) -> SweepRow:
        editing = None if cand is None else cand.editing
        key = digest(repr((users.validation, users.validation_quality)).encode(),
                     (editing.content_hash() if editing else "none").encode())[:20]
        setting = {} if cand is None else {"k": cand.k, "alpha": cand.alpha, "rank": cand.rank, "weight": cand.weight}
        row = SweepRow(**rows_cache.get_or(key, lambda: asdict(measure(
            model, world, pairs, users.validation_quality, editing, **setting)[0])))
        log(_format_row(row))
        return row

    rows = [validation_row(None)] + [validation_row(c) for c in edits]
    best = best_row(rows)
    chosen = None if best is rows[0] else next(
        c.editing for c in edits if best.setting == (c.k, c.rank, c.weight, c.alpha))
    if chosen is None:
        log(f"seed {model_seed}: no edit is more consistent than the unedited model within 1% NDCG on validation; "
            "the test measures the unedited model against itself")
    test_pairs = cons.equivalent_pairs(world, users.test)
    log(f"seed {model_seed}: test: {_family(best)} α={best.alpha:g} (chosen on validation) on {len(test_pairs)} "
        f"pairs of {len(users.test)} new users, quality on {len(users.test_quality)} new users")
    before = measure(model, world, test_pairs, users.test_quality, None)
    after = measure(model, world, test_pairs, users.test_quality, chosen, k=best.k, alpha=best.alpha, rank=best.rank,
                    weight=best.weight) if chosen is not None else before
    log(_format_header())
    log(_format_row(before[0]))
    log(_format_row(after[0]))
    fixes = {"alias": AliasMap(world.canonical_of), "duplicate": EventDedup(DUPLICATE_TOLERANCE_S)}
    alias, duplicates = (canonicalisation(model, world, users, test_pairs, chosen, args.seed, log, kind=kind,
                                          canonical=fixes[kind], what=what)
                         for kind, what in (("alias", "alias map on the features"),
                                            ("duplicate", f"duplicates collapsed within {DUPLICATE_TOLERANCE_S:g} s")))
    both = canonicalisation(model, world, users, test_pairs, chosen, args.seed, log, kind="duplicate",
                            canonical=Canonical(fixes["alias"], fixes["duplicate"]), what="alias map and duplicates")
    return SeedResult(model_seed, rows, best, chosen, before, after, alias, duplicates, both)


def canonicalisation(model: HSTUModel, world: SyntheticWorld, users: Users,
                     test_pairs: Sequence[cons.EquivalentPair], editing: EditingConfig | None, seed: int,
                     log: Callable[[str], None], *, kind: str, canonical: Canonicaliser,
                     what: str) -> dict[str, Any]:
    """A rewrite fixed where it belongs, on the features, measured on the test users: the ``kind`` pairs
    before and after ``canonical`` (they become one input: consistent by construction), the quality from
    the histories as the log writes them (aliases and duplicates in them) with and without it, and all
    rewrites with the chosen edit and ``canonical`` together."""
    edit = model.edit_from(editing)
    kind_pairs = [p for p in test_pairs if p.kind == kind]
    before = cons.consistency(model, world, kind_pairs)
    after = cons.consistency(model, world, kind_pairs, canonical=canonical)
    both = cons.consistency(model, world, test_pairs, edit, canonical=canonical)
    plain_q = cons.quality(model, world, users.test_quality, logged=True)
    mapped_q = cons.quality(model, world, users.test_quality, logged=True, canonical=canonical)
    change = cons.paired_quality_bootstrap(plain_q, mapped_q, query_users=len(users.test_quality), seed=seed)
    log(f"{what} (test): {kind} pairs' top10_same {before.top10_same:.3f} → {after.top10_same:.3f}; "
        f"NDCG@10 from logged histories {plain_q.ndcg10:.4f} → {mapped_q.ndcg10:.4f} "
        f"(95% [{100 * change[0]:+.2f}%, {100 * change[1]:+.2f}%]); all rewrites with the edit and it: "
        f"top10_same {both.top10_same:.3f}")
    return {f"{kind}_top10_same": {"before": before.top10_same, "after": after.top10_same},
            "logged_ndcg10": {"before": plain_q.ndcg10, "after": mapped_q.ndcg10, "change_95": change},
            "edit_and_map_top10_same": both.top10_same, "edit_and_map_by_rewrite": both.by_kind}


def eval_gr(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """For each base-model seed: train (or load), build the candidate edits, sweep them on validation,
    measure the choice on test users. Writes gr_sweep.json, the plot and the first seed's chosen edit."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    world = SyntheticWorld(WorldConfig(seed=args.seed))
    users = Users.of(args)
    t0 = time.monotonic()
    results = [run_seed(s, world, users, args, out, log) for s in args.model_seeds]
    runs = [cons.PairedRun(r.test_before[1], r.test_after[1], r.test_before[2], r.test_after[2]) for r in results]
    intervals = cons.paired_user_bootstrap(runs, pair_users=len(users.test), query_users=len(users.test_quality),
                                           seed=args.seed)
    base = mean_rows([r.test_before[0] for r in results])
    edited = mean_rows([r.test_after[0] for r in results])
    gain = round(100 * (edited.top10_same - base.top10_same), 2)
    na_gain = round(100 * (edited.non_alias_top10_same - base.non_alias_top10_same), 2)
    ndcg_change = round(float(np.mean([r.test_after[0].ndcg10 / r.test_before[0].ndcg10 - 1 for r in results])), 4)
    val_mean = [mean_rows(rows) for rows in zip(*(r.rows for r in results), strict=True)]
    oracle = cons.oracle_quality(world, users.test_quality)
    first = results[0]
    config_path = out / "gr_editing.json"
    for stale in (config_path, out / "gr_editing.npz"):  # never leave an earlier run's edit beside this run's figures
        stale.unlink(missing_ok=True)
    plot = plot_sweep(val_mean, out / "gr_alpha_sweep.png",
                      f"GR editing sweep ({args.method}, scope={args.scope}, validation, mean of "
                      f"{len(results)} base-model seed{'s' if len(results) > 1 else ''})")
    summary = {
        "test": {"baseline": asdict(base), "edited": asdict(edited), "pairs": len(results[0].test_before[1].same_by_pair),
                 "quality_queries": results[0].test_before[2].queries, "seeds": list(args.model_seeds),
                 "paired_bootstrap": intervals,
                 "top10_same_by_rewrite": {"before": base.top10_same_by_rewrite, "after": edited.top10_same_by_rewrite},
                 "top10_overlap_by_rewrite": {"before": base.top10_overlap_by_rewrite,
                                              "after": edited.top10_overlap_by_rewrite},
                 "top10_rbo_by_rewrite": {"before": base.top10_rbo_by_rewrite, "after": edited.top10_rbo_by_rewrite},
                 "non_alias": {"rewrites": list(INFORMATION_PRESERVING),
                               "top10_same": {"before": base.non_alias_top10_same, "after": edited.non_alias_top10_same},
                               "gain_points": na_gain,
                               "gain_points_95": intervals["non_alias_gain_points_95"]},
                 "by_seed": [{"seed": r.seed, "chosen": _setting_dict(r.best), "baseline": asdict(r.test_before[0]),
                              "edited": asdict(r.test_after[0])} for r in results]},
        "consistency_gain_points": gain,
        "non_alias_gain_points": na_gain,
        "ndcg10_change_relative": ndcg_change,
        "alias_canonicalisation": {"by_seed": [{"seed": r.seed, **r.alias} for r in results]},
        "duplicate_canonicalisation": {"tolerance_s": DUPLICATE_TOLERANCE_S,
                                       "by_seed": [{"seed": r.seed, **r.duplicates} for r in results]},
        "alias_and_duplicate_canonicalisation": {"by_seed": [{"seed": r.seed, **r.alias_and_duplicates}
                                                             for r in results]},
        "validation": {"pairs": len(users.validation) * len(REWRITES), "rows_mean": [asdict(r) for r in val_mean],
                       "by_seed": [{"seed": r.seed, "baseline": asdict(r.rows[0]), "best": asdict(r.best),
                                    "rows": [asdict(x) for x in r.rows], "degrades_at_alpha": degradation_alphas(r.rows)}
                                   for r in results]},
        "oracle": {"ndcg10": oracle.ndcg10, "hr10": oracle.hr10, "queries": oracle.queries},
        "plot": str(plot),
        "editing_config": str(config_path) if first.editing is not None else None,
        "method": args.method,
        "scope": args.scope,
        "seconds": round(time.monotonic() - t0, 1),
    }
    if first.editing is not None:
        config_path.write_text(json.dumps(editing_json(first.editing), indent=1))
        write_editing_npz(first.editing, out / "gr_editing.npz")
    (out / "gr_sweep.json").write_text(json.dumps(summary, indent=1))
    _log_summary(summary, intervals, log)
    return summary


def _setting_dict(r: SweepRow) -> dict[str, Any]:
    return {"k": r.k, "rank": r.rank, "weight": r.weight, "alpha": r.alpha}


def _log_summary(s: dict[str, Any], iv: dict[str, Any], log: Callable[[str], None]) -> None:
    t = s["test"]
    b, e = t["baseline"], t["edited"]
    log(f"test (new users, {len(t['seeds'])} seed(s)): top10_same {b['top10_same']:.3f} → {e['top10_same']:.3f} "
        f"({s['consistency_gain_points']:+.1f} points, 95% [{iv['gain_points_95'][0]:+.1f}, {iv['gain_points_95'][1]:+.1f}]); "
        f"without aliases {b['non_alias_top10_same']:.3f} → {e['non_alias_top10_same']:.3f} "
        f"({s['non_alias_gain_points']:+.1f} points, 95% [{iv['non_alias_gain_points_95'][0]:+.1f}, "
        f"{iv['non_alias_gain_points_95'][1]:+.1f}]); NDCG@10 {b['ndcg10']:.4f} → {e['ndcg10']:.4f} "
        f"({100 * s['ndcg10_change_relative']:+.2f}%, 95% [{100 * iv['ndcg10_change_95'][0]:+.2f}%, "
        f"{100 * iv['ndcg10_change_95'][1]:+.2f}%]; oracle {s['oracle']['ndcg10']:.4f})")
    for name, key in (("top10_same", "top10_same_by_rewrite"), ("top10_overlap", "top10_overlap_by_rewrite"),
                      ("top10_rbo", "top10_rbo_by_rewrite")):
        log(f"test, {name} by rewrite before → after: " + ", ".join(
            f"{k} {t[key]['before'][k]:.3f}→{t[key]['after'][k]:.3f}" for k in REWRITES))
    log("test, gain by rewrite (points, 95%): " + ", ".join(
        f"{k} [{lo:+.1f}, {hi:+.1f}]" for k, (lo, hi) in iv["gain_by_rewrite_95"].items()))
    log(f"wrote {s['plot']}, gr_sweep.json" + (f", {s['editing_config']} and .npz" if s["editing_config"] else
                                              " (no edit chosen: no gr_editing.json)"))
