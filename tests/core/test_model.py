"""The model's contract: cached ranking equals full recomputation; inputs are checked by field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relay_engine.core.config import parse_policy
from relay_engine.core.model import (
    MODEL_OPTIONS,
    WEIGHTS_FORMAT,
    History,
    HSTUModel,
    ModelConfig,
    ModelInputError,
    WeightsFileError,
)
from tests.models import SMALL, TOLERANCE, make_history, relative_error


def random_edit(config: ModelConfig, *, seed: int, scope: str, n_edits: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    pairs = torch.randperm(config.num_layers * config.num_heads, generator=g)[:n_edits].tolist()
    return {
        "fingerprint": {"num_layers": config.num_layers, "num_heads": config.num_heads,
                        "head_dim": config.head_dim},
        "scope": scope,
        "edits": [{"layer": p // config.num_heads, "head": p % config.num_heads, "alpha": 2.5,
                   "direction": torch.randn(config.head_dim, generator=g).tolist()} for p in pairs],
    }


# (config, prefix length, short-term length, candidates, timestamps, edit scope or None)
CASES = [
    (ModelConfig(num_items=500, embed_dim=16, num_layers=1, num_heads=1, head_dim=4, seed=1), 1, 0, 1, False, None),
    (ModelConfig(num_items=500, embed_dim=16, num_layers=1, num_heads=1, head_dim=4, seed=2), 1, 1, 1, True, None),
    (ModelConfig(num_items=2000, embed_dim=24, num_layers=3, num_heads=3, head_dim=8, block_rows=7, seed=3),
     37, 5, 11, False, None),
    (ModelConfig(num_items=2000, embed_dim=24, num_layers=3, num_heads=3, head_dim=8, block_rows=16, seed=4),
     200, 32, 512, True, None),
    (ModelConfig(num_items=5000, embed_dim=32, num_layers=2, num_heads=4, head_dim=8, block_rows=512, seed=5),
     4096, 32, 128, False, None),
    (ModelConfig(num_items=5000, embed_dim=32, num_layers=2, num_heads=2, head_dim=16, block_rows=300, seed=6),
     4096, 16, 64, True, None),
    (SMALL, 300, 20, 50, True, "all"),
    (SMALL, 300, 20, 50, False, "candidates"),
    (SMALL, 1000, 0, 7, True, "all"),
    # the reference HSTU's normaliser: every row divided by max_seq_len
    (ModelConfig(num_items=500, embed_dim=16, num_layers=1, num_heads=1, head_dim=4, attn_normaliser="constant",
                 max_seq_len=64, seed=7), 1, 0, 1, False, None),
    (ModelConfig(num_items=2000, embed_dim=24, num_layers=3, num_heads=3, head_dim=8, block_rows=16,
                 attn_normaliser="constant", max_seq_len=512, seed=8), 200, 32, 64, True, None),
    (ModelConfig(**{**SMALL.__dict__, "attn_normaliser": "constant"}), 300, 20, 50, True, "all"),
    (ModelConfig(**{**SMALL.__dict__, "attn_normaliser": "constant"}), 300, 20, 50, False, "candidates"),
    (ModelConfig(**{**SMALL.__dict__, "attn_normaliser": "constant", "ln_eps": 1e-6}), 1000, 0, 7, True, "all"),
]


@pytest.mark.parametrize(("config", "prefix_len", "short_len", "n_cands", "timestamps", "scope"), CASES)
def test_cached_rank_equals_full_recompute(config, prefix_len, short_len, n_cands, timestamps, scope):
    model = HSTUModel(config)
    edit = None
    if scope is not None:
        editing = parse_policy({"editing": random_edit(config, seed=prefix_len, scope=scope)}).editing
        edit = model.edit_from(editing)
    prefix = make_history(prefix_len, config, seed=1, timestamps=timestamps)
    short = make_history(short_len, config, seed=2, timestamps=timestamps, t0=10**9)
    candidates = torch.randint(0, config.num_items, (n_cands,), generator=torch.Generator().manual_seed(3))

    cached = model.rank(model.prefill(prefix, edit), short, candidates, edit=edit)
    full = model.rank_full(prefix, short, candidates, edit=edit)

    assert cached.shape == (n_cands,)
    assert relative_error(cached, full) <= TOLERANCE


def test_candidates_do_not_see_each_other():
    model = HSTUModel(SMALL)
    prefix = make_history(50, SMALL, seed=1)
    short = make_history(4, SMALL, seed=2)
    alone = model.rank_full(prefix, short, [7])
    together = model.rank_full(prefix, short, [7, 8, 9, 10])
    assert relative_error(together[:1], alone) <= TOLERANCE


def test_history_kv_does_not_depend_on_later_tokens():
    model = HSTUModel(SMALL)
    prefix = make_history(64, SMALL, seed=1)
    longer = prefix.concat(make_history(16, SMALL, seed=9))
    kv_short = model.prefill(prefix).kv
    kv_long = model.prefill(longer).kv[:, :, :, :64]
    assert torch.allclose(kv_short, kv_long, atol=1e-6, rtol=1e-5)


def test_an_edit_changes_the_scores():
    model = HSTUModel(SMALL)
    prefix, short = make_history(40, SMALL, seed=1), make_history(4, SMALL, seed=2)
    before = model.rank_full(prefix, short, [1, 2, 3])
    editing = parse_policy({"editing": random_edit(SMALL, seed=0, scope="all")}).editing
    after = model.rank_full(prefix, short, [1, 2, 3], edit=model.edit_from(editing))
    assert relative_error(after, before) > 1e-3


def test_a_prefix_cached_under_another_edit_is_refused():
    model = HSTUModel(SMALL)
    prefix, short = make_history(40, SMALL, seed=1), make_history(4, SMALL, seed=2)
    kv = model.prefill(prefix)
    editing = parse_policy({"editing": random_edit(SMALL, seed=0, scope="all")}).editing
    with pytest.raises(ModelInputError, match="edit"):
        model.rank(kv, short, [1], edit=model.edit_from(editing))


def test_prefix_kv_knows_its_size():
    model = HSTUModel(SMALL)
    for timestamps in (False, True):
        kv = model.prefill(make_history(123, SMALL, seed=1, timestamps=timestamps))
        assert kv.nbytes == model.prefix_nbytes(123, timestamps) == 123 * SMALL.kv_bytes_per_token(timestamps)
        assert kv.kv.shape == (SMALL.num_layers, 2, SMALL.num_heads, 123, SMALL.head_dim)


def test_same_config_same_weights_same_version():
    a, b = HSTUModel(SMALL), HSTUModel(SMALL)
    assert a.version == b.version
    prefix, short = make_history(10, SMALL, seed=1), make_history(2, SMALL, seed=2)
    assert torch.equal(a.rank_full(prefix, short, [1, 2]), b.rank_full(prefix, short, [1, 2]))
    assert HSTUModel(ModelConfig(**{**SMALL.__dict__, "seed": 99})).version != a.version


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda h: History(h.items.clone().fill_(10**6), h.actions, h.timestamps), "prefix.items"),
    (lambda h: History(h.items, h.actions.clone().fill_(-1), h.timestamps), "prefix.actions"),
    (lambda h: History(h.items.float(), h.actions, h.timestamps), "prefix.items"),
    (lambda h: History(h.items, h.actions[:-1], h.timestamps), "prefix.actions"),
    (lambda h: History(h.items[:0], h.actions[:0], None), "prefix"),
])
def test_bad_prefix_names_the_field(mutate, field):
    model = HSTUModel(SMALL)
    with pytest.raises(ModelInputError) as info:
        model.prefill(mutate(make_history(10, SMALL, seed=1)))
    assert info.value.field == field


@pytest.mark.parametrize(("candidates", "message"), [
    ([], "empty"),
    ([1, 10**7], "out of range"),
    ([1.5, 2.0], "integer"),
    ([[1, 2]], "1-D"),
])
def test_bad_candidates_name_the_field(candidates, message):
    model = HSTUModel(SMALL)
    prefix, short = make_history(10, SMALL, seed=1), make_history(2, SMALL, seed=2)
    with pytest.raises(ModelInputError, match=message) as info:
        model.rank(model.prefill(prefix), short, candidates)
    assert info.value.field == "candidates"


def test_timestamps_must_be_consistent_between_prefix_and_short_term():
    model = HSTUModel(SMALL)
    kv = model.prefill(make_history(10, SMALL, seed=1, timestamps=True))
    with pytest.raises(ModelInputError, match="timestamps"):
        model.rank(kv, make_history(2, SMALL, seed=2, timestamps=False), [1])


def test_an_edit_for_another_model_is_refused():
    model = HSTUModel(SMALL)
    other = ModelConfig(num_layers=SMALL.num_layers + 1, num_heads=SMALL.num_heads, head_dim=SMALL.head_dim)
    editing = parse_policy({"editing": random_edit(other, seed=0, scope="all")}).editing
    with pytest.raises(ModelInputError, match="fingerprint"):
        model.edit_from(editing)


def test_a_full_rank_can_keep_the_prefix_kv_it_computed():
    model = HSTUModel(SMALL)
    prefix = make_history(300, SMALL, seed=1, timestamps=True)
    short = make_history(8, SMALL, seed=2, timestamps=True, t0=10**9)
    scores, kv = model.rank_full_keeping_prefix(prefix, short, [1, 2, 3])
    assert relative_error(scores, model.rank_full(prefix, short, [1, 2, 3])) <= TOLERANCE
    reference = model.prefill(prefix)
    assert kv.length == 300 and kv.nbytes == reference.nbytes
    assert torch.allclose(kv.kv, reference.kv, atol=1e-5, rtol=1e-5)
    assert relative_error(model.rank(kv, short, [4, 5]), model.rank_full(prefix, short, [4, 5])) <= TOLERANCE


# --- the semantics options (``ModelConfig``; the reference HSTU's are set by the importer) -------------

REFERENCE_LIKE = ModelConfig(
    num_items=400, num_actions=3, embed_dim=16, num_layers=2, num_heads=2, head_dim=8, num_position_buckets=96,
    num_time_buckets=129, max_seq_len=96, block_rows=16, attn_normaliser="constant", ln_eps=1e-6, attn_scale="one",
    position_buckets="exact", time_buckets="gr", query_time="next", bias_needs_timestamps=True,
    input_positions=True, min_item_id=1, scoring="last_position", output_norm="l2", item_l2_norm=True)


def options() -> st.SearchStrategy[dict]:
    """Any combination of the semantics options."""
    return st.fixed_dictionaries({
        **{name: st.sampled_from(allowed) for name, allowed in MODEL_OPTIONS.items()},
        "ln_eps": st.sampled_from([1e-5, 1e-6]),
        "bias_needs_timestamps": st.booleans(),
        "input_positions": st.booleans(),
        "item_l2_norm": st.booleans(),
        "min_item_id": st.sampled_from([0, 1]),
    })


@settings(max_examples=40, deadline=None)
@given(opts=options(), prefix_len=st.integers(1, 70), short_len=st.integers(0, 20), n_cands=st.integers(1, 9),
       timestamps=st.booleans(), edit_scope=st.sampled_from([None, "all", "candidates"]), seed=st.integers(0, 9))
def test_every_combination_of_options_keeps_the_cached_path_exact(opts, prefix_len, short_len, n_cands, timestamps,
                                                                   edit_scope, seed):
    config = ModelConfig(num_items=300, embed_dim=16, num_layers=2, num_heads=2, head_dim=4, max_seq_len=96,
                         num_position_buckets=32, num_time_buckets=40, block_rows=16, seed=seed, **opts)
    model = HSTUModel(config)
    edit = None
    if edit_scope == "candidates" and config.scoring == "last_position":
        edit_scope = "all"  # a last-position model runs no candidate tokens (refused; tested below)
    if edit_scope is not None:
        edit = model.edit_from(parse_policy({"editing": random_edit(config, seed=seed, scope=edit_scope)}).editing)
    prefix = make_history(prefix_len, config, seed=seed, timestamps=timestamps)
    short = make_history(short_len, config, seed=seed + 1, timestamps=timestamps, t0=10**9)
    candidates = torch.randint(config.min_item_id, config.num_items, (n_cands,),
                               generator=torch.Generator().manual_seed(seed))
    query_ts = 2 * 10**9 if timestamps and seed % 2 else None

    kv = model.prefill(prefix, edit)
    cached = model.rank(kv, short, candidates, query_ts, edit=edit)
    full = model.rank_full(prefix, short, candidates, query_ts, edit=edit)

    assert kv.nbytes == model.prefix_nbytes(prefix_len, timestamps)
    assert relative_error(cached, full) <= TOLERANCE


@pytest.mark.parametrize("timestamps", [True, False])
@pytest.mark.parametrize(("prefix_len", "short_len"), [(1, 0), (2, 0), (1, 5), (64, 0), (64, 31)])
def test_a_last_position_model_with_next_token_times_caches_exactly(prefix_len, short_len, timestamps):
    model = HSTUModel(REFERENCE_LIKE)
    prefix = make_history(prefix_len, REFERENCE_LIKE, seed=1, timestamps=timestamps)
    short = make_history(short_len, REFERENCE_LIKE, seed=2, timestamps=timestamps, t0=10**9)
    kv = model.prefill(prefix)
    assert kv.tail is not None and kv.settled == prefix_len - 1
    cached, full = model.rank(kv, short, [5, 6, 7]), model.rank_full(prefix, short, [5, 6, 7])
    assert relative_error(cached, full) <= TOLERANCE


def test_the_normaliser_and_the_layer_norm_epsilon_enter_the_version():
    base = ModelConfig(**SMALL.__dict__)
    assert base.version() == SMALL.version()
    assert ModelConfig(**{**SMALL.__dict__, "attn_normaliser": "constant"}).version() != base.version()
    assert ModelConfig(**{**SMALL.__dict__, "ln_eps": 1e-6}).version() != base.version()


def test_the_normaliser_changes_the_scores():
    prefix, short = make_history(40, SMALL, seed=1), make_history(4, SMALL, seed=2)
    row = HSTUModel(SMALL).rank_full(prefix, short, [1, 2, 3])
    constant = HSTUModel(ModelConfig(**{**SMALL.__dict__, "attn_normaliser": "constant"})).rank_full(
        prefix, short, [1, 2, 3])
    assert relative_error(constant, row) > 1e-3


@pytest.mark.parametrize(("field", "value"), [("attn_normaliser", "softmax"), ("scoring", "x"), ("ln_eps", 0.0),
                                              ("min_item_id", 10**6), ("num_heads", 0)])
def test_a_bad_option_is_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{field: value})


def test_items_below_the_first_id_are_refused():
    model = HSTUModel(REFERENCE_LIKE)
    prefix = History.from_lists([3, 0, 4], [1, 1, 1])
    with pytest.raises(ModelInputError, match=r"out of range \[1, 399\]") as info:
        model.prefill(prefix)
    assert info.value.field == "prefix.items"
    with pytest.raises(ModelInputError) as info:
        model.rank_full(History.from_lists([3], [1]), History.from_lists([], []), [0, 5])
    assert info.value.field == "candidates"


def test_a_candidates_scoped_edit_is_refused_by_a_last_position_model():
    editing = parse_policy({"editing": random_edit(REFERENCE_LIKE, seed=0, scope="candidates")}).editing
    with pytest.raises(ModelInputError, match="last position") as info:
        HSTUModel(REFERENCE_LIKE).edit_from(editing)
    assert info.value.field == "editing.scope"


# --- weights files --------------------------------------------------------------------------------


def trained(config: ModelConfig, seed: int) -> HSTUModel:
    """A model whose weights no seed reproduces (as after training or an import)."""
    model = HSTUModel(config)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=torch.Generator().manual_seed(seed))
             for k, v in model.state_dict().items()}
    return HSTUModel.from_state_dict(config, state)


def test_a_saved_model_loads_with_the_same_scores_and_a_version_of_its_weights(tmp_path):
    model = trained(REFERENCE_LIKE, seed=1)
    model.save(tmp_path / "w.pt")
    loaded = HSTUModel.load(tmp_path / "w.pt")
    prefix = History.from_lists([5, 6, 7, 8], [1, 2, 1, 1], [10, 20, 30, 40])
    short = History.from_lists([9], [1], [50])
    assert torch.equal(loaded.rank_full(prefix, short, [1, 2, 3]), model.rank_full(prefix, short, [1, 2, 3]))
    assert loaded.config == REFERENCE_LIKE and loaded.version == model.version
    assert loaded.version != REFERENCE_LIKE.version() != trained(REFERENCE_LIKE, seed=2).version


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(WeightsFileError, match="no such file"):
        HSTUModel.load(tmp_path / "nope.pt")


@pytest.mark.parametrize(("content", "message"), [
    (b"not a torch file", "not a RelayGR weights file"),
    ({"model_state_dict": {}}, "not a RelayGR weights file"),
    ({"format": WEIGHTS_FORMAT, "format_version": 99, "config": {}, "state_dict": {}}, "format version 99"),
    ({"format": WEIGHTS_FORMAT, "format_version": 1, "config": {"colour": 1}, "state_dict": {}}, "colour"),
    ({"format": WEIGHTS_FORMAT, "format_version": 1, "config": {"scoring": "x"}, "state_dict": {}}, "scoring"),
])
def test_a_file_that_is_not_relaygr_weights_is_refused(tmp_path, content, message):
    path = tmp_path / "w.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(WeightsFileError, match=message):
        HSTUModel.load(path)


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda s: s | {"item_emb": s["item_emb"][:-1]}, "item_emb: has shape"),
    (lambda s: {k: v for k, v in s.items() if k != "layers.1.out_bias"}, "missing parameter layers.1.out_bias"),
    (lambda s: s | {"extra": torch.zeros(1)}, "unexpected parameter extra"),
    (lambda s: s | {"action_emb": s["action_emb"] * float("nan")}, "action_emb: has NaN"),
])
def test_weights_that_do_not_fit_the_config_are_refused_by_name(tmp_path, mutate, message):
    model = HSTUModel(SMALL)
    torch.save({"format": WEIGHTS_FORMAT, "format_version": 1, "config": dataclasses.asdict(SMALL),
                "state_dict": mutate(model.state_dict())}, tmp_path / "w.pt")
    with pytest.raises(WeightsFileError, match=message):
        HSTUModel.load(tmp_path / "w.pt")
