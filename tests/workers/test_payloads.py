"""Task payload validation (no Redis needed): every bad field named, good payloads become requests."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.features import SyntheticFeatures
from workers.payloads import PayloadError, PreInferPayload, RankPayload
from workers.settings import MODELS

FEATURES = SyntheticFeatures(MODELS["small"])


def test_rank_payload_by_lengths_derives_the_tokens_the_trace_describes():
    request = RankPayload.parse({"user_id": "u1", "seq_len": 20, "short_len": 3, "n_candidates": 5,
                                 "query_index": 7, "deadline_s": 1e9}).request(FEATURES)
    assert (len(request.prefix), len(request.short_term), len(request.candidates)) == (20, 3, 5)
    assert request.prefix.digest() == FEATURES.prefix("u1", 20).digest()
    assert torch.equal(request.candidates, FEATURES.candidates(7, 5))
    assert request.deadline_s == 1e9


def test_rank_payload_with_explicit_tokens_uses_them():
    request = RankPayload.parse({"user_id": "u1", "prefix_items": [1, 2, 3], "prefix_actions": [1, 1, 2],
                                 "short_items": [], "short_actions": [], "candidates": [9, 8]}).request(FEATURES)
    assert request.prefix.items.tolist() == [1, 2, 3]
    assert len(request.short_term) == 0
    assert request.candidates.tolist() == [9, 8]


def test_payload_round_trips_through_its_plain_form():
    payload = RankPayload.parse({"user_id": "u", "seq_len": 4, "short_len": 0, "n_candidates": 1})
    assert RankPayload.parse(payload.to_dict()) == payload


def test_every_bad_field_is_reported_at_once():
    with pytest.raises(PayloadError) as caught:
        RankPayload.parse({"user_id": "", "seq_len": 0, "short_len": 1.5, "n_candidates": True, "extra": 1})
    assert set(caught.value.errors) == {"user_id", "seq_len", "short_len", "n_candidates", "extra"}


@pytest.mark.parametrize(("data", "field"), [
    ({"user_id": "u", "seq_len": 4, "prefix_items": [1], "prefix_actions": [1]}, "seq_len"),
    ({"user_id": "u", "prefix_items": [1, 2]}, "prefix_actions"),
    ({"user_id": "u", "prefix_items": [1, "2"], "prefix_actions": [1, 1]}, "prefix_items"),
    ({"user_id": "u", "prefix_items": [2**64], "prefix_actions": [1]}, "prefix_items"),
    ({"user_id": "u" * 300, "seq_len": 4}, "user_id"),
    ({"user_id": "u"}, "seq_len"),
    ([1, 2], "payload"),
])
def test_malformed_pre_infer_payload_names_the_field(data, field):
    with pytest.raises(PayloadError) as caught:
        PreInferPayload.parse(data)
    assert caught.value.field == field


def test_deadline_must_be_a_finite_number():
    with pytest.raises(PayloadError, match="deadline_s"):
        RankPayload.parse({"user_id": "u", "seq_len": 4, "short_len": 0, "n_candidates": 1,
                           "deadline_s": float("nan")})
