"""Input-dependent (low-rank) head edits on the GR model, the rank-aware consistency measures, the alias
map as the fix for aliases, and the eval command with ``--method lowrank`` over two base-model seeds."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from relay_engine.core.features import AliasMap, EventDedup
from relay_engine.lab import consistency as cons
from relay_engine.lab.editing.cli import main as editing_main
from relay_engine.lab.editing.directions import build_editing
from relay_engine.lab.editing.fitting import cutoff_loss, fit_lowrank_maps
from relay_engine.lab.synthetic import INFORMATION_PRESERVING, REWRITES
from tests.lab.editing_helpers import (
    TINY_EVAL,
    assert_written_edit_matches_the_choice,
    kl_between_writings,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# --- rank-aware consistency --------------------------------------------------------------------------


def test_rbo_is_one_for_the_same_top10_and_charges_a_swap_at_the_top_more_than_at_the_cutoff():
    a = torch.arange(30.0).flip(0)  # item 0 best, then 1, 2, …
    assert cons.rank_biased_overlap(a, a.clone()) == pytest.approx(1.0)
    at_cutoff, at_top = a.clone(), a.clone()
    at_cutoff[[9, 10]] = at_cutoff[[10, 9]]  # ranks 10 and 11 swap: another item in the top-10
    at_top[[0, 10]] = at_top[[10, 0]]  # the best item drops to rank 11
    assert 0.9 < cons.rank_biased_overlap(a, at_cutoff) < 1.0
    assert cons.rank_biased_overlap(a, at_top) < cons.rank_biased_overlap(a, at_cutoff)
    assert cons.rank_biased_overlap(a, -a) == 0.0


def test_consistency_is_reported_per_rewrite_and_on_the_rewrites_that_keep_every_id(model, world):
    c = cons.consistency(model, world, cons.equivalent_pairs(world, range(900, 910)))
    assert list(c.by_kind) == list(c.overlap_by_kind) == list(c.rbo_by_kind) == list(REWRITES)
    keep = [s for s, k in zip(c.same_by_pair, c.kind_by_pair, strict=True) if k in INFORMATION_PRESERVING]
    assert c.same_share() == pytest.approx(np.mean(keep)) and len(keep) == 30
    assert c.same_share(["alias"]) == pytest.approx(c.by_kind["alias"])
    assert c.top10_rbo == pytest.approx(np.mean(c.rbo_by_pair))


def test_the_alias_map_makes_an_alias_rewrite_the_same_input(model, world):
    alias_map = AliasMap(world.canonical_of)
    pairs = cons.equivalent_pairs(world, range(920, 930), ["alias"])
    assert all(np.array_equal(alias_map.apply(p.rewritten.to_history()).items.numpy(), p.original.items)
               for p in pairs)
    c = cons.consistency(model, world, pairs, canonical=alias_map)
    assert c.top10_same == 1.0 and c.top10_rbo == pytest.approx(1.0)


def test_event_dedup_makes_a_duplicate_rewrite_the_same_input(model, world):
    dedup = EventDedup(1.0)
    pairs = cons.equivalent_pairs(world, range(930, 940), ["duplicate"])
    assert all(dedup.apply(p.rewritten.to_history()).digest() == p.original.to_history().digest() for p in pairs)
    assert cons.consistency(model, world, pairs, canonical=dedup).top10_same == 1.0


# --- fitting low-rank maps -------------------------------------------------------------------------------


def test_fitted_lowrank_maps_bring_equivalent_inputs_closer_and_serve_as_fitted(model, world):
    users = range(600, 612)
    maps = fit_lowrank_maps(model, world, users, rank=3, epochs=3, loss="kl", consistency_weight=5.0, lr=0.05)
    c = model.config
    assert [(m.layer, m.heads, m.rank) for m in maps] == [(li, (0, 1), 3) for li in range(c.num_layers)]
    for m in maps:
        assert torch.allclose(m.rotation @ m.rotation.T, torch.eye(3), atol=1e-5), "R has orthonormal rows"
    editing = build_editing(c.fingerprint(), {}, 1.0, maps=maps)
    assert editing.scope == "candidates" and not editing.edits and len(editing.lowrank) == c.num_layers
    edit = model.edit_from(editing)
    assert kl_between_writings(model, world, users, edit) < kl_between_writings(model, world, users)
    assert all(not p.requires_grad for p in model.parameters())
    h = world.user(3).history
    assert torch.equal(cons.score(model, h, world.candidates(), model.edit_from(build_editing(
        c.fingerprint(), {}, 0.0, maps=maps))), cons.score(model, h, world.candidates())), "α = 0 is no edit"


def test_the_cutoff_fit_lowers_its_loss_at_the_top10_boundary_on_the_fitting_users(model, world):
    users = range(640, 652)
    maps = fit_lowrank_maps(model, world, users, rank=4, epochs=3, loss="cutoff", consistency_weight=1.0)

    def boundary_loss(edit=None) -> float:
        return sum(float(cutoff_loss(cons.score(model, p.original, world.candidates(), edit),
                                     cons.score(model, p.rewritten, world.candidates(), edit)))
                   for p in cons.equivalent_pairs(world, users, INFORMATION_PRESERVING))

    assert boundary_loss(model.edit_from(build_editing(model.config.fingerprint(), {}, 1.0, maps=maps))) \
        < boundary_loss()


def test_a_rank_beyond_the_heads_width_is_refused(model, world):
    with pytest.raises(ValueError, match=r"rank 9: must be in \[1, 8\]"):
        fit_lowrank_maps(model, world, range(3), rank=9)


# --- the eval command ----------------------------------------------------------------------------------


def test_eval_lowrank_reports_the_test_section_over_two_seeds_and_resumes_from_its_caches(tmp_path, capsys):
    argv = ["eval", "--method", "lowrank", "--out", str(tmp_path), *TINY_EVAL[:-2], "--model-seeds", "0,1",
            "--fit-users", "6", "--fit-epochs", "1", "--ranks", "2", "--fit-weights", "5", "--alphas", "1,2"]
    assert editing_main(argv) == 0
    first = capsys.readouterr().out
    assert "fit (rank 2, w 5) …" in first and "alias map on the features" in first
    sweep = json.loads((tmp_path / "gr_sweep.json").read_text())
    test = sweep["test"]
    assert {"baseline", "edited", "paired_bootstrap", "non_alias", "by_seed"} <= set(test)
    assert set(test["top10_same_by_rewrite"]["before"]) == set(test["top10_same_by_rewrite"]["after"]) == set(REWRITES)
    assert test["seeds"] == [0, 1] and [s["seed"] for s in test["by_seed"]] == [0, 1]
    assert test["non_alias"]["rewrites"] == list(INFORMATION_PRESERVING)
    assert sweep["non_alias_gain_points"] == round(100 * (test["edited"]["non_alias_top10_same"]
                                                          - test["baseline"]["non_alias_top10_same"]), 2)
    for seed in sweep["validation"]["by_seed"]:
        assert [(r["rank"], r["weight"], r["alpha"]) for r in seed["rows"]] == [(0, 0.0, 0.0), (2, 5.0, 1.0),
                                                                              (2, 5.0, 2.0)]
    assert len(sweep["alias_canonicalisation"]["by_seed"]) == 2
    assert all(s["alias_top10_same"]["after"] == 1.0 for s in sweep["alias_canonicalisation"]["by_seed"])
    # duplicates collapsed on the features: a duplicate rewrite is the same input, so agreement is whole
    dup = sweep["duplicate_canonicalisation"]
    assert dup["tolerance_s"] == 1.0 and len(dup["by_seed"]) == 2
    assert all(s["duplicate_top10_same"]["after"] == 1.0 for s in dup["by_seed"])
    assert "duplicates collapsed within 1 s" in first
    assert_written_edit_matches_the_choice(tmp_path, sweep)

    assert editing_main(argv) == 0
    again = capsys.readouterr().out
    assert "fit (rank 2, w 5): loaded from" in again and "training on" not in again
    assert json.loads((tmp_path / "gr_sweep.json").read_text())["test"] == test
