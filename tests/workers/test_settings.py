"""Worker settings from the environment: defaults, overrides, and errors naming the variable."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core import wire
from relay_engine.core.model import HSTUModel
from workers.settings import MODELS, Settings, SettingsError


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


def test_a_weights_file_is_a_model_setting(tmp_path):
    model = HSTUModel(MODELS["small"])
    model = HSTUModel.from_state_dict(model.config, {k: v * 1.5 for k, v in model.state_dict().items()})
    model.save(tmp_path / "w.pt")
    settings = Settings.from_env({"RELAYGR_MODEL": str(tmp_path / "w.pt")})
    served = settings.build_model(torch.device("cpu"))
    assert settings.model_config == MODELS["small"]
    assert served.version == model.version != HSTUModel(MODELS["small"]).version
    assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), model.state_dict().values(),
                                                  strict=True))


def test_a_missing_weights_file_names_the_variable(tmp_path):
    with pytest.raises(SettingsError, match="neither a preset") as caught:
        Settings.from_env({"RELAYGR_MODEL": str(tmp_path / "nope.pt")})
    assert caught.value.variable == "RELAYGR_MODEL"


def test_a_file_that_is_not_weights_names_the_variable_and_the_problem(tmp_path):
    (tmp_path / "w.pt").write_text("hello")
    settings = Settings.from_env({"RELAYGR_MODEL": str(tmp_path / "w.pt")})
    with pytest.raises(SettingsError, match="not a RelayGR weights file") as caught:
        settings.build_model(torch.device("cpu"))
    assert caught.value.variable == "RELAYGR_MODEL"


def test_weights_that_do_not_fit_their_config_name_the_variable_and_the_parameter(tmp_path):
    HSTUModel(MODELS["small"]).save(tmp_path / "w.pt")
    blob = torch.load(tmp_path / "w.pt", weights_only=True)
    blob["state_dict"]["item_emb"] = blob["state_dict"]["item_emb"][:10]
    torch.save(blob, tmp_path / "w.pt")
    settings = Settings.from_env({"RELAYGR_MODEL": str(tmp_path / "w.pt")})
    with pytest.raises(SettingsError, match="item_emb: has shape") as caught:
        settings.build_model(torch.device("cpu"))
    assert caught.value.variable == "RELAYGR_MODEL"
