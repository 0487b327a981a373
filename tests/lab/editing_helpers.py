"""Shared by the editing tests: a tiny synthetic world, tiny eval sizes, and checks of what the eval writes."""

from __future__ import annotations

import json

import numpy as np
import torch

from relay_engine.core.config import validate_policy
from relay_engine.lab import consistency as cons
from relay_engine.lab.synthetic import INFORMATION_PRESERVING, WorldConfig

TINY_WORLD = WorldConfig(num_topics=4, items_per_topic=8, num_aliased=8, min_sessions=2, max_sessions=3)

TINY_EVAL = ["--train-users", "40", "--train-seconds", "1", "--probe-users", "20", "--eval-users", "6",
             "--test-users", "5", "--quality-users", "10", "--model-seeds", "0"]


def assert_written_edit_matches_the_choice(out, sweep) -> None:
    """gr_editing.json/.npz exist exactly when validation chose an edit, and hold a valid section."""
    chosen = sweep["test"]["by_seed"][0]["chosen"]
    written = out / "gr_editing.json"
    assert written.exists() == (chosen["k"] > 0) == (sweep["editing_config"] is not None)
    if written.exists():
        doc = json.loads(written.read_text())
        assert validate_policy({"editing": doc["editing"]})[1] == {}
        assert doc["editing"]["provenance"]["alpha"] == chosen["alpha"]
        with np.load(out / "gr_editing.npz", allow_pickle=False) as npz:
            assert json.loads(str(npz["provenance"])) == doc["editing"]["provenance"]


def kl_between_writings(model, world, users, edit=None, kinds=INFORMATION_PRESERVING) -> float:
    total = 0.0
    for p in cons.equivalent_pairs(world, users, kinds):
        a = torch.log_softmax(cons.score(model, p.original, world.candidates(), edit), -1)
        b = torch.log_softmax(cons.score(model, p.rewritten, world.candidates(), edit), -1)
        total += float(torch.nn.functional.kl_div(b, a, log_target=True, reduction="sum"))
    return total
