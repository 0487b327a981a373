"""A model edit served by real workers: published as a revision's ``editing`` section, ACKed by every
instance, invalidating the prefixes cached under the previous edit, and scoring exactly as a local model
with the same edit.

The revision goes the way the control plane sends it (``DesiredRevision`` JSON at the pool's desired key
plus a poke, ``relay_engine.core.wire``); the tokens are the worker's own ``SyntheticFeatures`` of the
request, so the local reference sees the same prefix, short-term tokens and candidates.
"""

from __future__ import annotations

import time

import pytest
import torch

from relay_engine.core.config import parse_policy
from relay_engine.core.editing_io import editing_json
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel
from relay_engine.lab.editing.directions import build_editing
from tests.models import random_lowrank
from tests.workers.fleet import wait_for
from workers.settings import MODELS

pytestmark = pytest.mark.integration

CONVERGE_S = 3.0
REL_TOL = 1e-5
REQUEST = {"seq_len": 96, "short_len": 6, "n_candidates": 32}


def edit_spec(alpha: float, scope: str, seed: int) -> dict:
    """A policy whose editing section biases two heads of the small model along seeded directions."""
    fp = MODELS["small"].fingerprint()
    g = torch.Generator().manual_seed(seed)
    dirs = {(0, 1): torch.randn(fp.head_dim, generator=g), (1, 0): torch.randn(fp.head_dim, generator=g)}
    cfg = build_editing(fp, dirs, alpha, scope=scope, provenance={"dataset_hash": f"test-{seed}"})
    return {"trigger": {"at_risk_seq_len": 1}, "editing": editing_json(cfg)["editing"]}


def lowrank_spec(alpha: float, seed: int) -> dict:
    """A policy whose editing section maps every head of every layer of the small model (rank 4), candidates only."""
    section = random_lowrank(MODELS["small"].fingerprint(), seed=seed, rank=4, alpha=alpha)
    return {"trigger": {"at_risk_seq_len": 1}, "editing": {**section, "provenance": {"dataset_hash": f"lr-{seed}"}}}


def acked(fleet, generation: int) -> bool:
    statuses = fleet.statuses()
    return len(statuses) == len(fleet.names) and all(
        s.config_state == "ACK" and s.applied_generation == generation for s in statuses.values())


def users_on_every_instance(fleet) -> list[str]:
    """One user routed to each instance of the pool (the same users for the whole test)."""
    by_instance: dict[str, str] = {}
    for i in range(200):
        by_instance.setdefault(fleet.client.route(f"edit-user-{i}"), f"edit-user-{i}")
        if len(by_instance) == len(fleet.names):
            return [by_instance[name] for name in sorted(by_instance)]
    raise AssertionError(f"200 users cover only {sorted(by_instance)} of {fleet.names}")


def rank(fleet, user: str, query_index: int):
    return fleet.client.rank(user, query_index=query_index, deadline_s=time.time() + 10, **REQUEST)


def local_scores(spec: dict, user: str, query_index: int) -> torch.Tensor:
    """The reference: the small model with the same edit, recomputing everything (``rank_full``)."""
    config = MODELS["small"]
    model = HSTUModel(config)
    features = SyntheticFeatures(config)
    return model.rank_full(features.prefix(user, REQUEST["seq_len"]),
                           features.short_term(user, query_index, REQUEST["short_len"]),
                           features.candidates(query_index, REQUEST["n_candidates"]),
                           edit=model.edit_from(parse_policy(spec).editing))


def assert_close(served: list[float], reference: torch.Tensor) -> None:
    served_t = torch.tensor(served, dtype=torch.float64)
    ref = reference.double()
    err = float((served_t - ref).abs().max() / ref.abs().max())
    assert err <= REL_TOL, f"served scores differ from the local edited model by {err:.2e} (relative, max norm)"


def test_a_published_edit_is_acked_invalidates_old_prefixes_and_scores_like_the_local_model(fleet):
    users = users_on_every_instance(fleet)
    old_spec = edit_spec(alpha=2.0, scope="all", seed=1)
    new_spec = edit_spec(alpha=3.0, scope="all", seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        old = fleet.publish(old_spec)
        wait_for(lambda: acked(fleet, old), CONVERGE_S, what=f"ACK of generation {old} (first edit)")
        for user in users:  # cache each user's prefix under the old edit, and see it hit
            assert rank(fleet, user, 1).source == "miss"
            cached = rank(fleet, user, 2)
            assert cached.source == "hbm"
            assert_close(cached.scores, local_scores(old_spec, user, 2))

        new = fleet.publish(new_spec)
        wait_for(lambda: acked(fleet, new), CONVERGE_S, what=f"ACK of generation {new} (second edit)")
        sha = parse_policy(new_spec).sha256()
        assert all(s.applied_sha256 == sha and s.error == "" for s in fleet.running_statuses())

        served_by = set()
        for user in users:
            first = rank(fleet, user, 3)
            assert first.source == "miss", "a prefix cached under the old edit must never be used"
            second = rank(fleet, user, 4)
            assert second.source == "hbm" and second.instance == first.instance
            served_by.add(second.instance)
            for reply, query_index in ((first, 3), (second, 4)):
                reference = local_scores(new_spec, user, query_index)
                assert_close(reply.scores, reference)
                assert not torch.allclose(torch.tensor(reply.scores), local_scores(old_spec, user, query_index),
                                          rtol=1e-3, atol=1e-4), "the new edit changes the scores"
        assert served_by == set(fleet.names)
    finally:
        torch.set_num_threads(threads)
        restore = fleet.publish({})  # the package's other tests expect an unedited pool
        wait_for(lambda: acked(fleet, restore), CONVERGE_S, what="ACK of the unedited revision")


def test_a_published_lowrank_edit_misses_once_then_hits_and_scores_like_the_local_model(fleet):
    users = users_on_every_instance(fleet)
    spec = lowrank_spec(alpha=1.0, seed=7)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        generation = fleet.publish(spec)
        wait_for(lambda: acked(fleet, generation), CONVERGE_S, what=f"ACK of generation {generation} (low-rank edit)")
        for user in users:
            first = rank(fleet, user, 5)
            assert first.source == "miss", "the edit is new: nothing is cached under its hash"
            second = rank(fleet, user, 6)
            assert second.source == "hbm" and second.instance == first.instance
            for reply, query_index in ((first, 5), (second, 6)):
                assert_close(reply.scores, local_scores(spec, user, query_index))
            unedited = local_scores({}, user, 6)
            assert not torch.allclose(torch.tensor(second.scores), unedited, rtol=1e-3, atol=1e-4), \
                "the low-rank edit changes the scores"
    finally:
        torch.set_num_threads(threads)
        restore = fleet.publish({})
        wait_for(lambda: acked(fleet, restore), CONVERGE_S, what="ACK of the unedited revision")
