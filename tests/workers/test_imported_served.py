"""A model imported from generative-recommenders and served by a real worker process
(``RELAYGR_MODEL=<weights file>``): it ranks exactly as the same file loaded locally does with
``rank_full``, on a miss and from the prefix cache that miss kept."""

from __future__ import annotations

import time

import pytest
import torch

from relay_engine.core.model import History, HSTUModel
from relay_engine.lab.gr_import import ReferenceSettings, convert
from tests.gr_reference import reference_state
from tests.models import TOLERANCE, relative_error
from tests.workers.fleet import Fleet

pytestmark = pytest.mark.integration

HEADS = 2
NUM_ITEMS = 500


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    state = reference_state(num_items=NUM_ITEMS, embed_dim=16, seq_len=64, num_layers=2, num_heads=HEADS,
                            dqk=8, dv=8, seed=11)
    config, ours = convert(state, ReferenceSettings(HEADS))
    path = tmp_path_factory.mktemp("imported") / "weights.pt"
    HSTUModel.from_state_dict(config, ours).save(path)
    return path


@pytest.fixture(scope="module")
def imported_fleet(redis_url, tmp_path_factory, weights):
    pool = Fleet(redis_url, tmp_path_factory.mktemp("imported-logs"), pool="imported", size=1, model=str(weights))
    try:
        yield pool.start()
    finally:
        pool.stop()


def test_a_worker_serving_an_imported_file_ranks_as_the_local_model(imported_fleet, weights):
    g = torch.Generator().manual_seed(3)
    items = torch.randint(1, NUM_ITEMS + 1, (45,), generator=g)
    ts = 1_700_000_000 + torch.cumsum(torch.randint(0, 90_000, (45,), generator=g), 0)
    candidates = torch.randint(1, NUM_ITEMS + 1, (32,), generator=g)
    query_ts = int(ts[-1]) + 30
    fields = {"prefix_items": items[:40].tolist(), "prefix_actions": [1] * 40, "prefix_timestamps": ts[:40].tolist(),
              "short_items": items[40:].tolist(), "short_actions": [1] * 5, "short_timestamps": ts[40:].tolist(),
              "candidates": candidates.tolist(), "query_timestamp": query_ts}
    local = HSTUModel.load(weights)
    history = History(items, torch.ones(45, dtype=torch.int64), ts)
    expected = local.rank_full(history[:40], history[40:], candidates, query_ts)

    miss = imported_fleet.client.rank("imported-user", deadline_s=time.time() + 30, **fields)
    hit = imported_fleet.client.rank("imported-user", deadline_s=time.time() + 30, **fields)

    assert (miss.source, hit.source) == ("miss", "hbm")
    for reply in (miss, hit):
        assert relative_error(torch.tensor(reply.scores), expected) <= TOLERANCE
