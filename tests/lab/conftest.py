"""Fixtures of the editing tests: a tiny synthetic world and model, run on one thread."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.model import HSTUModel
from relay_engine.lab.synthetic import SyntheticWorld
from tests.lab.editing_helpers import TINY_WORLD


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one thread is fastest, and on a shared CPU far faster than a contended pool."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def world() -> SyntheticWorld:
    return SyntheticWorld(TINY_WORLD)


@pytest.fixture(scope="module")
def model(world) -> HSTUModel:
    return HSTUModel(world.model_config(embed_dim=16, num_layers=2, num_heads=2, head_dim=4))
