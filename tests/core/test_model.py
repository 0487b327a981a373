"""The model's contract: cached ranking equals full recomputation; inputs are checked by field."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.config import parse_policy
from relay_engine.core.model import History, HSTUModel, ModelConfig, ModelInputError
from tests.models import SMALL, make_history, random_lowrank

TOLERANCE = 1e-5  # max abs error relative to the scores' max abs value, float32


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


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


# --- input-dependent (low-rank) edits ------------------------------------------------------------


def lowrank_edit(model: HSTUModel, *, seed: int, scope: str, alpha: float = 1.0):
    section = random_lowrank(model.config.fingerprint(), seed=seed, scope=scope, alpha=alpha)
    return model.edit_from(parse_policy({"editing": section}).editing)


@pytest.mark.parametrize("scope", ["all", "candidates"])
def test_cached_rank_equals_full_recompute_under_a_lowrank_edit(scope):
    model = HSTUModel(SMALL)
    edit = lowrank_edit(model, seed=1, scope=scope)
    prefix = make_history(300, SMALL, seed=1, timestamps=True)
    short = make_history(20, SMALL, seed=2, timestamps=True, t0=10**9)
    candidates = torch.arange(50)
    full = model.rank_full(prefix, short, candidates, edit=edit)
    assert relative_error(model.rank(model.prefill(prefix, edit), short, candidates, edit=edit), full) <= TOLERANCE
    assert relative_error(full, model.rank_full(prefix, short, candidates)) > 1e-3, "the edit changes the scores"


def test_a_lowrank_edit_adds_alpha_R_transposed_times_W_h_plus_b_minus_R_h_to_the_heads():
    model = HSTUModel(SMALL)
    section = random_lowrank(SMALL.fingerprint(), seed=3, scope="all", alpha=0.7, layers=(1,))
    edit = model.edit_from(parse_policy({"editing": section}).editing)
    history = make_history(30, SMALL, seed=1)
    plain, edited = [], []
    model.forward(history, torch.arange(5), head_capture=plain)
    model.forward(history, torch.arange(5), edit=edit, head_capture=edited)
    assert torch.equal(edited[0], plain[0]), "layer 0 carries no map"
    m = section["lowrank"][0]
    r, w, b = (torch.tensor(m[k]) for k in ("rotation", "source_weight", "source_bias"))
    # layer 1 reads layer 0's output, which the edit left alone, so its unedited heads are plain[1]
    h = plain[1].reshape(plain[1].shape[0], -1)  # [rows, H·D]
    expected = h + 0.7 * (h @ w.T + b - h @ r.T) @ r
    assert torch.allclose(edited[1].reshape_as(h), expected, atol=1e-5)


def test_a_lowrank_map_whose_source_is_its_rotation_changes_nothing():
    model = HSTUModel(SMALL)
    section = random_lowrank(SMALL.fingerprint(), seed=4, scope="all")
    for m in section["lowrank"]:
        m["source_weight"], m["source_bias"] = m["rotation"], [0.0] * len(m["source_bias"])
    edit = model.edit_from(parse_policy({"editing": section}).editing)
    prefix, short = make_history(40, SMALL, seed=1), make_history(4, SMALL, seed=2)
    assert relative_error(model.rank_full(prefix, short, [1, 2, 3], edit=edit),
                          model.rank_full(prefix, short, [1, 2, 3])) <= TOLERANCE


def test_a_candidates_scope_lowrank_edit_leaves_the_prefix_kv_as_it_was():
    model = HSTUModel(SMALL)
    prefix = make_history(100, SMALL, seed=1, timestamps=True)
    edited = model.prefill(prefix, lowrank_edit(model, seed=5, scope="candidates"))
    assert torch.equal(edited.kv, model.prefill(prefix).kv)
    assert edited.edit_hash != "none"


def test_bias_and_lowrank_edits_of_one_layer_both_read_its_unedited_outputs():
    model = HSTUModel(SMALL)
    section = random_lowrank(SMALL.fingerprint(), seed=6, scope="all", layers=(0,))
    bias = {"layer": 0, "head": 1, "alpha": 2.0, "direction": [0.5] * SMALL.head_dim}
    both = model.edit_from(parse_policy({"editing": {**section, "edits": [bias]}}).editing)
    only_map = model.edit_from(parse_policy({"editing": section}).editing)
    history = make_history(20, SMALL, seed=1)
    with_both, with_map = [], []
    model.forward(history, torch.arange(3), edit=both, head_capture=with_both)
    model.forward(history, torch.arange(3), edit=only_map, head_capture=with_map)
    difference = with_both[0] - with_map[0]  # [rows, H, D]
    assert torch.allclose(difference[:, 1], torch.full_like(difference[:, 1], 1.0), atol=1e-5)
    assert torch.equal(difference[:, 0], torch.zeros_like(difference[:, 0]))
