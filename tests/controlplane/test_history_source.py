"""PROMETHEUS_URL: checked when the settings load, and a Prometheus that cannot be reached is a 503 naming it."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from controlplane.settings.base import _prometheus_url
from workers.embedded_redis import free_port


@pytest.mark.parametrize("raw", ["prometheus:9090", "ftp://prometheus", "http://", "http://p:99999",
                                 "http://p:9090/?x=1"])
def test_a_malformed_prometheus_url_is_refused_naming_the_setting(raw):
    with pytest.raises(ImproperlyConfigured, match="PROMETHEUS_URL"):
        _prometheus_url(raw)


def test_an_empty_prometheus_url_means_redis_holds_the_history():
    assert _prometheus_url("") is None
    assert _prometheus_url("http://prometheus:9090/") == "http://prometheus:9090"


def test_history_from_an_unreachable_prometheus_is_a_503_naming_it(viewer, pool, redis_on, settings):
    settings.PROMETHEUS_URL = f"http://127.0.0.1:{free_port()}"
    response = viewer.get(f"/api/v1/pools/{pool.name}/metrics/?window=1h")
    assert response.status_code == 503
    assert "PROMETHEUS_URL" in response.json()["detail"]


def test_the_live_window_reads_redis_even_with_prometheus_set(viewer, pool, redis_on, settings):
    settings.PROMETHEUS_URL = f"http://127.0.0.1:{free_port()}"
    assert viewer.get(f"/api/v1/pools/{pool.name}/metrics/?window=5m").status_code == 200


def test_kept_points_give_back_what_was_read_and_keep_only_final_ones():
    import numpy as np

    from controlplane.telemetry.promql import MAX_KEPT_POINTS, KeptPoints

    kept = KeptPoints()
    step = 60
    counts = np.arange(10 * 3, dtype=float).reshape(10, 3)
    gauges = -np.arange(10 * 2, dtype=float).reshape(10, 2)
    assert kept.first_missing(0, step, 10) == 0
    # The first read: every point; those ending at or before 420 s are final and kept.
    out = kept.merged(0, step, 0, (counts, gauges), final_end=420)
    assert all((a == b).all() for a, b in zip(out, (counts, gauges), strict=True))
    assert kept.first_missing(0, step, 10) == 7
    # A later read of the same window: the kept points, then the fresh ones after them, in order.
    fresh = (counts[7:] + 100, gauges[7:] - 100)
    out = kept.merged(0, step, 7, fresh, final_end=540)
    assert (out[0] == np.concatenate([counts[:7], counts[7:] + 100])).all()
    assert (out[1] == np.concatenate([gauges[:7], gauges[7:] - 100])).all()
    assert kept.first_missing(0, step, 10) == 9
    # The window slid two points on: its first points are the kept ones it still spans.
    assert kept.first_missing(2 * step, step, 10) == 7
    # A kept point is a copy: changing what a caller got back leaves it alone.
    out[0][0, 0] = -1
    assert kept.merged(0, step, 9, (counts[9:], gauges[9:]), final_end=0)[0][0, 0] == 0
    # Bounded: the oldest go first.
    many = np.zeros((MAX_KEPT_POINTS + 5, 1))
    kept.merged(0, step, 0, (many,), final_end=float("inf"))
    assert kept.first_missing(0, step, 5) == 0
    assert kept.first_missing(5 * step, step, MAX_KEPT_POINTS) == MAX_KEPT_POINTS


def test_a_pages_p95_weighs_the_poll_after_a_new_minute_by_how_often_the_page_meets_one():
    from controlplane.telemetry.bench_prometheus import Reading

    def reading(view, walls, turns):
        return Reading("1h", view, 10.0, 1, 0.0, max(walls), 0.0, 0.0, 1, turn_ms=turns, walls=walls)

    walls = [float(ms) for ms in range(1, 101)]  # 1 … 100 ms
    # Polling every second, one poll in 60 follows a new minute: three slow ones barely move the P95.
    assert reading("live", walls, [500.0, 500.0, 500.0]).page_p95_ms == 97.0
    # Every 2 s (the overview), one in 30: the slowest 3.3 % are after a minute, the P95 is a warm poll still.
    assert reading("overview", walls, [500.0]).page_p95_ms == 99.0
    assert reading("live", walls, []).page_p95_ms == 100.0  # no turns: the warm P95 as given


def test_prometheus_answers_are_decoded_as_counts_and_a_bad_value_costs_only_itself():
    import numpy as np

    from controlplane.telemetry.promql import PrometheusHistory

    class Answering(PrometheusHistory):
        def __init__(self, result):
            super().__init__("http://prometheus.invalid", timeout_s=1)
            self.result = result

        def _get(self, path, **params):
            return self.result

    start, step = 1_000.0, 60
    values = [[1060, "5"], [1120.4, "NaN"], [1180, "-1"], [1240, "1e400"], [1300, "abc"], [1360, {"x": 1}],
              [1420], "junk", [99999, "7"], [1000, "8"], [1480, "+Inf"], [1540, "2.5"]]
    [(labels, samples)] = Answering([{"metric": {"column": "sum"}, "values": values}])._range("q", start, step, 10)
    assert labels == {"column": "sum"}
    assert dict(zip(*(part.tolist() for part in samples.valid), strict=True)) == {0: 5.0, 8: 2.5}
    # Every string value well formed: decoded at once, the same way.
    good = [[start + step * (i + 1), str(i * 1.5)] for i in range(10)]
    [(_, samples)] = Answering([{"metric": {}, "values": good}])._range("q", start, step, 10)
    np.testing.assert_array_equal(samples.value, np.arange(10) * 1.5)
    np.testing.assert_array_equal(samples.index, np.arange(10))
    # An instant answer: one value a series, NaN where it is not a count.
    answers = Answering([{"metric": {"instance": "a"}, "value": [1, "3"]}, {"metric": {"instance": "b"}, "value": "x"},
                         {"metric": {"instance": "c"}, "value": [1, "-2"]}])._instant("q", 1.0)
    assert [float(samples.value[0]) for _, samples in answers][0] == 3.0
    assert all(np.isnan(samples.value[0]) for _, samples in answers[1:])
