"""Importing generative-recommenders' research HSTU: the imported model ranks as the reference does
(an independent re-implementation of it, ``tests/gr_reference.py``), its cached path stays exact,
and variants it cannot represent are refused by name."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.model import History, HSTUModel
from relay_engine.lab.gr_import import ReferenceSettings, UnsupportedCheckpoint, convert, main
from tests.gr_reference import reference_scores, reference_state
from tests.models import TOLERANCE, relative_error

REFERENCE_TOLERANCE = 1e-4  # two float32 computations of the same function, summed in different orders
N = 48  # the reference's padded length (max_sequence_len + max_output_len)
HEADS = 2
SHAPE = dict(num_items=300, embed_dim=16, seq_len=N, num_layers=2, num_heads=HEADS, dqk=8, dv=8)


def imported(seed: int = 0, **settings) -> tuple[dict, HSTUModel]:
    state = reference_state(**SHAPE, seed=seed)
    config, ours = convert(state, ReferenceSettings(HEADS, **settings))
    return state, HSTUModel.from_state_dict(config, ours)


def user(length: int, *, seed: int, timestamps: bool) -> History:
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(1, SHAPE["num_items"] + 1, (length,), generator=g)
    ts = 1_700_000_000 + torch.cumsum(torch.randint(0, 90_000, (length,), generator=g), 0) if timestamps else None
    return History(items, torch.ones(length, dtype=torch.int64), ts)


CANDIDATES = torch.arange(1, SHAPE["num_items"] + 1, 7)


@pytest.mark.parametrize("timestamps", [True, False])
@pytest.mark.parametrize("length", [1, 2, 17, N - 1, N])
def test_the_imported_model_ranks_as_the_reference(length, timestamps):
    state, model = imported()
    history = user(length, seed=length, timestamps=timestamps)
    # the target's time, which the reference writes after the history (a full history has no slot for it)
    target_ts = int(history.timestamps[-1]) + 5_000 if timestamps and length < N else None
    expected = reference_scores(state, num_heads=HEADS, items=history.items, timestamps=history.timestamps,
                                target_timestamp=target_ts, candidates=CANDIDATES)
    split = length // 2
    ours = model.rank_full(history[:split], history[split:], CANDIDATES, query_timestamp=target_ts)
    assert relative_error(ours, expected) <= REFERENCE_TOLERANCE


@pytest.mark.parametrize(("user_norm", "item_l2"), [("layer_norm", True), ("l2_norm", False)])
def test_the_reference_output_normalisations_map_too(user_norm, item_l2):
    state, model = imported(seed=1, user_embedding_norm=user_norm, item_l2_norm=item_l2)
    history = user(30, seed=2, timestamps=True)
    expected = reference_scores(state, num_heads=HEADS, items=history.items, timestamps=history.timestamps,
                                target_timestamp=int(history.timestamps[-1]) + 60, candidates=CANDIDATES,
                                user_embedding_norm=user_norm, item_l2_norm=item_l2)
    ours = model.rank_full(history[:20], history[20:], CANDIDATES, query_timestamp=int(history.timestamps[-1]) + 60)
    assert relative_error(ours, expected) <= REFERENCE_TOLERANCE


@pytest.mark.parametrize("timestamps", [True, False])
@pytest.mark.parametrize(("prefix_len", "short_len"), [(1, 0), (1, 3), (30, 0), (30, 10), (N - 1, 1)])
def test_the_imported_models_cached_path_is_exact(prefix_len, short_len, timestamps):
    _, model = imported(seed=3)
    history = user(prefix_len + short_len, seed=4, timestamps=timestamps)
    prefix, short = history[:prefix_len], history[prefix_len:]
    query_ts = int(history.timestamps[-1]) + 10 if timestamps else None
    cached = model.rank(model.prefill(prefix), short, CANDIDATES, query_timestamp=query_ts)
    full = model.rank_full(prefix, short, CANDIDATES, query_timestamp=query_ts)
    assert relative_error(cached, full) <= TOLERANCE


# How train.py names a checkpoint of SHAPE: the model's debug string first, then similarity, sampling, loss…
TRAIN_PY_NAME = (f"HSTU-b2-h{HEADS}-dqk8-dv8-lsilud0.2-ad0.0_DotProduct_local-l2-eps1e-06_ssl-t0.05-n128-b128"
                 f"-lr0.001-wu0-wd0-2024-04-11_ep3")


def save_train_py_checkpoint(path, state) -> None:
    torch.save({"epoch": 3, "model_state_dict": {f"module.{k}": v for k, v in state.items()},  # DDP-wrapped
                "optimizer_state_dict": {"state": {}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.98)}]}}, path)


def test_a_train_py_checkpoint_imports_through_the_command(tmp_path, capsys):
    state = reference_state(**SHAPE, seed=5)
    save_train_py_checkpoint(tmp_path / TRAIN_PY_NAME, state)
    out = tmp_path / "weights.pt"
    assert main([str(tmp_path / TRAIN_PY_NAME), "--out", str(out)]) == 0  # the name gives the head count
    assert f"RELAYGR_MODEL={out}" in capsys.readouterr().out
    model = HSTUModel.load(out)
    history = user(20, seed=6, timestamps=True)
    expected = reference_scores(state, num_heads=HEADS, items=history.items, timestamps=history.timestamps,
                                target_timestamp=int(history.timestamps[-1]), candidates=CANDIDATES)
    assert relative_error(model.rank_full(history, history[:0], CANDIDATES), expected) <= REFERENCE_TOLERANCE


def _with(extra: dict):
    return lambda s: s | extra


def _without(suffix: str):
    return lambda s: {k: v for k, v in s.items() if not k.endswith(suffix)}


@pytest.mark.parametrize(("mutate", "settings", "difference"), [
    (_with({"_ndp_module._gating.weight": torch.zeros(2, 2)}), {}, "MoL"),
    (_with({"_embedding_module._item_id_to_category_id": torch.zeros(300, dtype=torch.int64)}), {},
     "CategoricalEmbeddingModule"),
    (_with({"_input_features_preproc._rating_emb.weight": torch.zeros(5, 4)}), {}, "embeds ratings"),
    (_without("_rel_attn_bias._pos_w"), {}, "enable_relative_attention_bias"),
    (_with({"_hstu._attention_layers.0._extra": torch.zeros(3)}), {}, "_hstu._attention_layers.0._extra"),
    (None, {"normalization": "softmax_rel_bias"}, "softmax"),
    (None, {"concat_ua": True}, "concat_ua"),
    (None, {"linear_activation": "none"}, "linear_activation"),
])
def test_an_unsupported_variant_is_refused_naming_the_difference(mutate, settings, difference):
    state = reference_state(**SHAPE, seed=7)
    with pytest.raises(UnsupportedCheckpoint, match=difference):
        convert(mutate(state) if mutate else state, ReferenceSettings(HEADS, **settings))


def test_different_qk_and_v_head_dims_are_refused():
    state = reference_state(**{**SHAPE, "dqk": 4}, seed=8)
    with pytest.raises(UnsupportedCheckpoint, match=r"dqk=4.*dv=8"):
        convert(state, ReferenceSettings(HEADS))


def test_the_command_refuses_with_the_difference_and_writes_nothing(tmp_path, capsys):
    state = reference_state(**SHAPE, seed=9)
    torch.save(state, tmp_path / "ckpt")
    out = tmp_path / "weights.pt"
    assert main([str(tmp_path / "ckpt"), "--num-heads", str(HEADS), "--out", str(out), "--concat-ua"]) == 2
    assert "concat_ua" in capsys.readouterr().err
    assert not out.exists()


def test_a_head_count_the_checkpoint_name_contradicts_is_refused(tmp_path, capsys):
    save_train_py_checkpoint(tmp_path / TRAIN_PY_NAME, reference_state(**SHAPE, seed=10))
    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / TRAIN_PY_NAME), "--num-heads", "4", "--out", str(tmp_path / "w.pt")])
    assert exit_.value.code == 2 and "name says h2" in capsys.readouterr().err


def test_weights_that_contradict_the_checkpoint_name_are_refused(tmp_path, capsys):
    name = TRAIN_PY_NAME.replace("HSTU-b2-", "HSTU-b3-")  # a renamed file: the weights have two blocks
    save_train_py_checkpoint(tmp_path / name, reference_state(**SHAPE, seed=10))
    assert main([str(tmp_path / name), "--out", str(tmp_path / "w.pt")]) == 2
    assert "name says HSTU-b3-h2-dqk8-dv8, its weights read as b2-h2-dqk8-dv8" in capsys.readouterr().err
