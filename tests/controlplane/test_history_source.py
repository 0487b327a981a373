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
