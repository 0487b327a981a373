from __future__ import annotations

import pytest

from relay_engine.core.model import ModelConfig
from tests.models import SMALL


@pytest.fixture
def small_config() -> ModelConfig:
    return SMALL
