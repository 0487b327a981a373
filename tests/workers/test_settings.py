"""Worker settings from the environment: defaults, overrides, and errors naming the variable."""

from __future__ import annotations

import pytest

from relay_engine.core import wire
from workers.settings import Settings, SettingsError


def test_defaults_follow_the_wire_contract():
    settings = Settings.from_env({})
    assert settings.key_prefix == wire.DEFAULT_KEY_PREFIX
    assert settings.heartbeat_timeout_s == wire.HEARTBEAT_TIMEOUT_S
    assert settings.keys.rank_queue("default.0") == "relaygr.default.0.rank"


def test_environment_and_flags_set_the_pool():
    env = {"REDIS_URL": "redis://h:1/2", "RELAYGR_KEY_PREFIX": "p", "RELAYGR_POOL": "main",
           "RELAYGR_POOL_SIZE": "3", "RELAYGR_MODEL": "small", "RELAYGR_TORCH_THREADS": "2"}
    settings = Settings.from_env(env, pool="canary")
    assert (settings.redis_url, settings.key_prefix, settings.pool, settings.pool_size) == \
        ("redis://h:1/2", "p", "canary", 3)
    assert Settings.from_env(settings.worker_env()) == settings


@pytest.mark.parametrize(("env", "variable"), [
    ({"RELAYGR_POOL_SIZE": "many"}, "RELAYGR_POOL_SIZE"),
    ({"RELAYGR_POOL_SIZE": "0"}, "RELAYGR_POOL_SIZE"),
    ({"RELAYGR_POOL": "Main Pool"}, "RELAYGR_POOL"),
    ({"RELAYGR_MODEL": "huge"}, "RELAYGR_MODEL"),
    ({"REDIS_URL": "localhost:6379"}, "REDIS_URL"),
    ({"RELAYGR_HEARTBEAT_INTERVAL_S": "10"}, "RELAYGR_HEARTBEAT_INTERVAL_S"),
])
def test_bad_setting_names_its_variable(env, variable):
    with pytest.raises(SettingsError) as caught:
        Settings.from_env(env)
    assert caught.value.variable == variable
