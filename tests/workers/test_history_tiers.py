"""RELAYGR_HISTORY: which telemetry tiers an instance writes (``wire.HISTORY_TIERS``)."""

import pytest

from relay_engine.core.wire import LIVE_TIER, TELEMETRY_TIERS
from workers.settings import Settings, SettingsError


def test_by_default_an_instance_writes_every_tier():
    assert Settings.from_env({}).telemetry_tiers == tuple(TELEMETRY_TIERS)


def test_with_prometheus_holding_the_history_an_instance_writes_only_the_live_tier():
    settings = Settings.from_env({"RELAYGR_HISTORY": "prometheus"})
    assert settings.telemetry_tiers == (LIVE_TIER,)
    assert Settings.from_env(settings.worker_env()).history == "prometheus"


def test_an_unknown_history_backend_is_refused_naming_the_variable():
    with pytest.raises(SettingsError, match="RELAYGR_HISTORY: must be one of redis, prometheus, got 'prom'"):
        Settings.from_env({"RELAYGR_HISTORY": "prom"})


@pytest.mark.parametrize("history", ["prometheus", "redis"])
def test_the_live_tier_keeps_six_minutes_where_prometheus_holds_the_history_else_ten(history, redis_url, key_prefix):
    """Redis keeps what it serves: the live view's 5 min window (and the sample before it) where Prometheus
    holds everything longer; the live tier's whole 10 min where Redis holds every tier."""
    import random
    import time

    import redis

    from controlplane.telemetry.bench import _snapshot
    from relay_engine.core.wire import PROMETHEUS_LIVE_KEPT, PoolKeys, tier_kept
    from workers.telemetry_publisher import TelemetryWriter

    kept = PROMETHEUS_LIVE_KEPT if history == "prometheus" else TELEMETRY_TIERS[LIVE_TIER][1]
    assert tier_kept(LIVE_TIER, history) == kept and (kept == 360) == (history == "prometheus")
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = PoolKeys("tiers", prefix=key_prefix)
    writer, rng, t0 = TelemetryWriter(client, keys, history), random.Random(1), time.time() - 1000
    for i in range(kept + 20):
        writer.write(_snapshot("tiers.0", t0 + i, t0 - 100, rng), [LIVE_TIER])
    key = keys.telemetry(LIVE_TIER, "tiers.0")
    assert client.xlen(key) == kept and 0 < client.ttl(key) <= kept
    client.close()
