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
