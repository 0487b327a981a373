"""Editing for semantic consistency: rewrites, probes, directions, the editing section, the eval command."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from relay_engine.core.config import EditingConfig, parse_policy, to_plain, validate_policy
from relay_engine.core.editing_io import editing_json
from relay_engine.core.engine import PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.model import History, HSTUModel
from relay_engine.lab import consistency as cons
from relay_engine.lab.editing.cli import main as editing_main
from relay_engine.lab.editing.directions import build_editing, directions
from relay_engine.lab.editing.fitting import fit_head_biases
from relay_engine.lab.editing.gr_eval import SweepRow, best_row, gr_probe_data
from relay_engine.lab.editing.probes import HeadProbe, locate_heads, probe_provenance, split_by_group
from relay_engine.lab.synthetic import REWRITES, train
from tests.lab.editing_helpers import (
    TINY_EVAL,
    assert_written_edit_matches_the_choice,
    kl_between_writings,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def planted(n: int = 400, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [n, 2, 3, 4] of noise, except head (1, 2), whose first coordinate carries the label."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < 0.5).float()
    acts = torch.randn(n, 2, 3, 4, generator=g)
    acts[:, 1, 2, 0] += 3.0 * labels
    return acts, labels


# --- the synthetic world ------------------------------------------------------------------------


def test_a_user_is_the_same_every_time_it_is_generated(world):
    a, b = world.user(7), world.user(7)
    for part in ("items", "actions", "timestamps", "session"):
        assert np.array_equal(getattr(a.history, part), getattr(b.history, part))
    assert np.array_equal(a.targets, b.targets)


@pytest.mark.parametrize("kind", REWRITES)
def test_a_rewrite_keeps_the_behaviours_of_each_session(world, kind):
    h = world.user(3).history
    r = world.rewrite(h, kind, np.random.default_rng(0))
    assert np.all(np.diff(r.timestamps) >= 0), "time order is kept"
    for s in np.unique(h.session):
        before = sorted(zip(h.items[h.session == s], h.actions[h.session == s], strict=True))
        after = sorted(set(zip(world.canonical_of[r.items[r.session == s]], r.actions[r.session == s], strict=True)))
        assert sorted(set(before)) == after
    if kind == "alias":
        assert np.array_equal(world.canonical_of[r.items], h.items) and not np.array_equal(r.items, h.items)
    if kind == "duplicate":
        assert len(h.items) < len(r.items) <= len(h.items) + 3
    if kind == "time_shift":
        first = np.array([r.timestamps[r.session == s][0] - h.timestamps[h.session == s][0]
                          for s in np.unique(h.session)])
        assert np.array_equal(r.timestamps - h.timestamps, first[h.session]), "sessions move as a whole"


def test_training_beats_the_untrained_model_on_held_out_next_items(world):
    m = HSTUModel(world.model_config(embed_dim=16, num_layers=1, num_heads=2, head_dim=4, seed=1))
    users = range(10_000, 10_060)
    before = cons.quality(m, world, users)
    train(m, world, users=range(80), epochs=2, lr=1e-2)
    after = cons.quality(m, world, users)
    assert after.ndcg10 > before.ndcg10
    assert all(not p.requires_grad for p in m.parameters())


# --- metrics ------------------------------------------------------------------------------------------


def test_kendall_tau_is_one_for_the_same_order_and_minus_one_reversed():
    a = torch.tensor([0.1, 0.5, 0.3, 0.9])
    assert cons.kendall_tau(a, a * 2 + 1) == pytest.approx(1.0)
    assert cons.kendall_tau(a, -a) == pytest.approx(-1.0)


def test_top10_agreement_ignores_order_inside_the_top10():
    a = torch.arange(20.0)
    b = a.clone()
    b[10:] = b[10:].flip(0)  # the 10 best, reversed among themselves
    assert cons.top_k_same(a, b)
    b[0], b[19] = b[19], b[0]
    assert not cons.top_k_same(a, b)


# --- probes and directions ------------------------------------------------------------------------


def test_locate_heads_ranks_the_head_that_carries_the_label_first():
    acts, labels = planted()
    val_mask = torch.from_numpy(split_by_group(np.arange(len(labels)) // 4))
    top, probes = locate_heads(acts, labels, val_mask, k=2)
    assert (top[0].layer, top[0].head) == (1, 2)
    assert top[0].val_accuracy > 0.9
    assert len(probes) == 6 and max(p.val_accuracy for p in probes[1:]) < 0.7


def test_held_out_groups_never_appear_in_training():
    groups = np.repeat(np.arange(10), 3)
    mask = split_by_group(groups, val_fraction=0.4)
    assert set(groups[mask]).isdisjoint(groups[~mask]) and len(set(groups[mask])) == 4


def test_mean_shift_is_mean_of_consistent_minus_mean_of_all():
    acts, labels = planted()
    head = HeadProbe(1, 2, 1.0, 1.0)
    d = directions(acts, labels, [head], "mean_shift")[(1, 2)]
    expected = acts[labels == 1, 1, 2].mean(0) - acts[:, 1, 2].mean(0)
    assert torch.allclose(d, expected, atol=1e-5)


def test_iti_direction_is_the_mean_shift_scaled_to_one_std_along_it():
    acts, labels = planted()
    head = HeadProbe(1, 2, 1.0, 1.0)
    shift = directions(acts, labels, [head], "mean_shift")[(1, 2)]
    iti = directions(acts, labels, [head], "iti")[(1, 2)]
    unit = shift / shift.norm()
    assert torch.allclose(iti / iti.norm(), unit, atol=1e-5)
    assert float(iti.norm()) == pytest.approx(float((acts[:, 1, 2] @ unit).std()), rel=1e-4)


def test_an_unknown_method_is_refused():
    acts, labels = planted()
    with pytest.raises(ValueError, match="method"):
        directions(acts, labels, [HeadProbe(0, 0, 1, 1)], "pca")


# --- the editing section -----------------------------------------------------------------------------


def built_editing(model: HSTUModel, alpha: float = 2.0) -> EditingConfig:
    acts, labels = planted()
    acts = torch.randn(len(labels), model.config.num_layers, model.config.num_heads, model.config.head_dim,
                       generator=torch.Generator().manual_seed(1)) + labels[:, None, None, None]
    heads = [HeadProbe(1, 0, 0.9, 0.95), HeadProbe(0, 1, 0.8, 0.85)]
    dirs = directions(acts, labels, heads, "iti")
    prov = probe_provenance(method="iti", k=2, dataset_hash="abc123", samples=len(labels),
                                    consistent_share=0.5, heads=heads)
    return build_editing(model.config.fingerprint(), dirs, alpha, scope="all", provenance=prov)


def test_the_built_edit_is_a_valid_editing_section_with_provenance(model):
    cfg = built_editing(model)
    spec, errors = validate_policy({"editing": to_plain(cfg)})
    assert errors == {} and spec.editing == cfg
    prov = cfg.provenance
    assert prov["dataset_hash"] == "abc123" and prov["k"] == 2 and prov["method"] == "iti" and prov["alpha"] == 2.0
    assert [(p["layer"], p["head"]) for p in prov["probe_accuracies"]] == [(1, 0), (0, 1)]
    assert {(e.layer, e.head) for e in cfg.edits} == {(1, 0), (0, 1)}


def test_the_json_file_round_trips_to_the_same_content_hash(model):
    cfg = built_editing(model)
    doc = json.loads(json.dumps(editing_json(cfg)))
    assert parse_policy({"editing": doc["editing"]}).editing.content_hash() == doc["content_hash"]


def test_another_alpha_is_another_content_hash(model):
    assert built_editing(model, 2.0).content_hash() != built_editing(model, 3.0).content_hash()


def test_an_edit_changes_scores_only_where_it_is_passed(model, world):
    h = world.user(1).history
    before = cons.score(model, h, world.candidates())
    edited = cons.score(model, h, world.candidates(), model.edit_from(built_editing(model)))
    assert not torch.allclose(edited, before)
    assert torch.equal(cons.score(model, h, world.candidates()), before), "the model holds no edit of its own"


def test_the_engine_serves_the_built_edit_exactly_as_rank_full(model, world):
    engine = RelayEngine(model=HSTUModel(model.config), device="cpu",
                         policy=parse_policy({"trigger": {"at_risk_seq_len": 1}}))
    prefix, short = world.user(2).history.to_history(), History.from_lists([3, 4], [1, 2], None)
    prefix = History(prefix.items, prefix.actions, None)
    cands = world.candidates().tolist()
    assert engine.pre_infer(PreInferRequest("u", prefix)).admitted
    engine.apply_policy(parse_policy({"editing": to_plain(built_editing(engine.model))}))
    result = engine.rank(RankRequest("u", prefix, short, cands))
    assert result.source == "miss", "a prefix cached under the old edit is never used"
    assert engine.rank(RankRequest("u", prefix, short, cands)).source == "hbm"
    full = engine.model.rank_full(prefix, short, cands, edit=engine.edit)
    assert torch.allclose(torch.tensor(result.scores), full, rtol=1e-4, atol=1e-5)


# --- GR probe data and the eval command ----------------------------------------------------------------


def test_each_probe_sample_is_labelled_by_its_pairs_top10_agreement(model, world):
    users = range(500, 506)
    data = gr_probe_data(model, world, users)
    c = model.config
    assert data.activations.shape == (len(users) * len(REWRITES), c.num_layers, c.num_heads, c.head_dim)
    pairs = cons.equivalent_pairs(world, users)
    expected = [cons.top_k_same(cons.score(model, p.original, world.candidates()),
                                cons.score(model, p.rewritten, world.candidates())) for p in pairs]
    assert data.labels.tolist() == [float(e) for e in expected]
    assert gr_probe_data(model, world, users).dataset_hash == data.dataset_hash


def test_eval_command_prints_the_table_and_writes_plot_and_its_choice(tmp_path, capsys):
    code = editing_main(["eval", "--method", "iti", "--out", str(tmp_path), *TINY_EVAL, "--ks", "1,2",
                         "--alphas", "2"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "non-alias" in printed and "NDCG@10" in printed and "test (new users, 1 seed(s))" in printed
    assert (tmp_path / "gr_alpha_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sweep = json.loads((tmp_path / "gr_sweep.json").read_text())
    (val,) = sweep["validation"]["by_seed"]
    assert [(r["k"], r["alpha"]) for r in val["rows"]] == [(0, 0.0), (1, 2.0), (2, 2.0)]
    # the reported figures come from the test users, measured with the setting validation chose
    test = sweep["test"]
    assert (test["edited"]["k"], test["edited"]["alpha"]) == (val["best"]["k"], val["best"]["alpha"])
    assert test["pairs"] == 5 * len(REWRITES) and test["quality_queries"] == 10 * 3
    assert sweep["consistency_gain_points"] == round(
        100 * (test["edited"]["top10_same"] - test["baseline"]["top10_same"]), 2)
    assert_written_edit_matches_the_choice(tmp_path, sweep)


def test_best_row_is_the_most_consistent_without_aliases_within_1_percent_ndcg_or_the_baseline():
    def row(k: int, non_alias: float, ndcg: float) -> SweepRow:
        return SweepRow(k, 1.0, non_alias, 0.9, 0.9, ndcg, 0.5, non_alias_top10_same=non_alias)

    base = row(0, 0.70, 0.300)
    assert best_row([base, row(1, 0.80, 0.2985), row(2, 0.90, 0.290), row(3, 0.75, 0.31)]).k == 1
    assert best_row([base, row(1, 0.65, 0.31), row(2, 0.95, 0.25)]) is base


def test_fitted_head_vectors_bring_equivalent_inputs_closer_on_the_fitting_users(model, world):
    users = range(600, 612)
    dirs = fit_head_biases(model, world, users, epochs=3, consistency_weight=5.0, lr=0.1)
    c = model.config
    assert sorted(dirs) == [(li, hi) for li in range(c.num_layers) for hi in range(c.num_heads)]
    cfg = build_editing(c.fingerprint(), dirs, 1.0, scope="candidates")
    assert kl_between_writings(model, world, users, model.edit_from(cfg)) < kl_between_writings(model, world, users)
    assert all(not p.requires_grad for p in model.parameters())


def test_eval_command_fits_head_vectors_with_the_fit_method(tmp_path, capsys):
    code = editing_main(["eval", "--out", str(tmp_path), "--method", "fit", *TINY_EVAL, "--fit-users", "6",
                         "--fit-epochs", "1", "--alphas", "1"])
    assert code == 0
    assert "fit epoch 1/1" in capsys.readouterr().out
    sweep = json.loads((tmp_path / "gr_sweep.json").read_text())
    rows = sweep["validation"]["by_seed"][0]["rows"]
    assert [(r["k"], r["weight"], r["alpha"]) for r in rows] == [(0, 0.0, 0.0), (12, 5.0, 1.0)]  # every head
    assert_written_edit_matches_the_choice(tmp_path, sweep)


def test_user_bootstrap_intervals_cover_the_measured_change_and_pair_the_draws(model, world):
    users, q_users = range(700, 712), range(800, 815)
    pairs = cons.equivalent_pairs(world, users)
    before_c, before_q = cons.consistency(model, world, pairs), cons.quality(model, world, q_users)
    assert len(before_c.same_by_pair) == len(pairs) and len(before_q.ndcg_by_query) == before_q.queries
    assert np.mean(before_c.same_by_pair) == before_c.top10_same
    unchanged = cons.PairedRun(before_c, before_c, before_q, before_q)
    same = cons.paired_user_bootstrap([unchanged], pair_users=len(users), query_users=len(q_users), samples=100)
    assert same["gain_points_95"] == same["non_alias_gain_points_95"] == same["ndcg10_change_95"] == [0.0, 0.0]
    assert same["gain_by_rewrite_95"] == {k: [0.0, 0.0] for k in REWRITES}  # paired: no spread at all
    edit = model.edit_from(build_editing(
        model.config.fingerprint(), {(0, 0): torch.ones(model.config.head_dim)}, 3.0))
    after_c, after_q = cons.consistency(model, world, pairs, edit), cons.quality(model, world, q_users, edit)
    iv = cons.paired_user_bootstrap([cons.PairedRun(before_c, after_c, before_q, after_q)], pair_users=len(users),
                                    query_users=len(q_users), samples=500)
    gain = 100 * (after_c.top10_same - before_c.top10_same)
    assert iv["gain_points_95"][0] <= gain <= iv["gain_points_95"][1]
    na_gain = 100 * (after_c.same_share() - before_c.same_share())
    assert iv["non_alias_gain_points_95"][0] <= na_gain <= iv["non_alias_gain_points_95"][1]
    change = after_q.ndcg10 / before_q.ndcg10 - 1
    assert iv["ndcg10_change_95"][0] <= change <= iv["ndcg10_change_95"][1]
    two_seeds = cons.paired_user_bootstrap([cons.PairedRun(before_c, after_c, before_q, after_q), unchanged],
                                           pair_users=len(users), query_users=len(q_users), samples=500)
    assert two_seeds["gain_points_95"] == pytest.approx([v / 2 for v in iv["gain_points_95"]]), \
        "seeds are averaged on the same draw of users"
