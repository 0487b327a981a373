"""Cost models: fitted from measured points, saved and loaded as files, compared for the time scale."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from relay_engine.lab.costmodel import (
    CostModel,
    CostModelError,
    ProfilePoint,
    fit,
    profile_grid,
    time_scale_against,
)

TRUE = {"prefill": (2.0, 0.01, 1e-5), "rank": (1.0, 0.02, 1e-4, 0.0, 0.0), "rank_full": (3.0, 0.01, 2e-5, 1e-4)}


def true_model() -> CostModel:
    return CostModel({op: tuple(c) for op, c in TRUE.items()})


def measured_points() -> list[ProfilePoint]:
    truth = true_model()
    points = []
    for n, s, c in profile_grid():
        points.append(ProfilePoint("prefill", n, 0, 0, truth.prefill_ms(n)))
        points.append(ProfilePoint("rank", n, s, c, truth.rank_ms(n, s, c)))
        points.append(ProfilePoint("rank_full", n, s, c, truth.rank_full_ms(n, s, c)))
    return points


def test_fitting_exact_measurements_recovers_the_times():
    fitted = fit(measured_points())
    truth = true_model()
    for n, s, c in [(300, 16, 64), (3000, 32, 128), (6000, 64, 256)]:
        assert fitted.prefill_ms(n) == pytest.approx(truth.prefill_ms(n), rel=1e-6)
        assert fitted.rank_ms(n, s, c) == pytest.approx(truth.rank_ms(n, s, c), rel=1e-6)
        assert fitted.rank_full_ms(n, s, c) == pytest.approx(truth.rank_full_ms(n, s, c), rel=1e-6)
    assert all(e < 1e-6 for e in fitted.fit_errors().values())


def test_a_saved_model_loads_back_and_a_file_of_points_is_fitted_on_load(tmp_path):
    fitted = fit(measured_points(), device="cpu", note="test")
    fitted.save(tmp_path / "m.json")
    loaded = CostModel.load(tmp_path / "m.json")
    assert loaded.device == "cpu" and loaded.note == "test"
    for op, coef in fitted.coefficients.items():
        assert loaded.coefficients[op] == pytest.approx(coef)
    data = json.loads((tmp_path / "m.json").read_text())
    del data["coefficients"]  # an accelerator's measurements alone
    (tmp_path / "points.json").write_text(json.dumps(data))
    assert CostModel.load(tmp_path / "points.json").rank_full_ms(2048, 32, 128) == pytest.approx(
        fitted.rank_full_ms(2048, 32, 128), rel=1e-6)


@pytest.mark.parametrize(("change", "fragment"), [
    ({"format": "other"}, "format"),
    ({"coefficients": {"prefill": [1, 2], "rank": [0] * 5, "rank_full": [0] * 4}}, "coefficients.prefill"),
    ({"coefficients": {"prefill": [1, -2, 0], "rank": [0] * 5, "rank_full": [0] * 4}}, "coefficients.prefill"),
    ({"points": [{"op": "rank", "n": 0, "s": 1, "c": 1, "ms": 1.0}]}, "points[0]"),
    ({"dispersion": {"rank": -0.1}}, "dispersion.rank"),
    ({"dispersion": {"decode": 0.1}}, "dispersion.decode"),
    ({"dispersion": [0.1]}, "dispersion must be an object"),
])
def test_a_bad_file_is_refused_naming_what_is_wrong(tmp_path, change, fragment):
    data = {**fit(measured_points()).to_dict(), **change}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(CostModelError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        CostModel.load(tmp_path / "bad.json")


def test_the_dispersion_of_forwards_is_saved_and_kept_when_scaled(tmp_path):
    model = replace(fit(measured_points()), dispersion={"rank": 0.2, "prefill": 0.15})
    model.save(tmp_path / "m.json")
    loaded = CostModel.load(tmp_path / "m.json")
    assert loaded.dispersion == {"rank": 0.2, "prefill": 0.15}
    assert loaded.scaled(2.0).dispersion == loaded.dispersion
    assert "dispersion" not in fit(measured_points()).to_dict()  # a profile without it: every forward its mean


def test_the_time_scale_of_a_uniformly_slower_device_is_its_slowdown():
    m = true_model()
    assert time_scale_against(m.scaled(3.0), m) == pytest.approx(3.0)


def test_the_full_inference_latency_model_follows_rank_full():
    m = true_model()
    lm = m.full_inference_model(32, 128)
    for n in (256, 1024, 4096):
        assert lm.predict_ms(n) == pytest.approx(m.rank_full_ms(n, 32, 128), rel=0.02)
