"""Prefills in a child process (``prefill_process``): the same caches as the lane thread computes,
edits applied, a child that dies replaced, the share as the child's nice and its pauses."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.lane import nice_for_share
from relay_engine.core.model import HSTUModel
from relay_engine.core.prefill_process import PrefillProcess, PrefillProcessError
from tests.models import SMALL, make_history

from .test_model import random_edit

LINUX_PRIORITIES = pytest.mark.skipif(not hasattr(os, "getpriority"), reason="no per-process priorities here")
SHORT = make_history(8, SMALL, seed=100)
CANDS = list(range(20))


@pytest.fixture(scope="module")
def model() -> HSTUModel:
    return HSTUModel(SMALL, "cpu")


@pytest.fixture
def process(model):
    p = PrefillProcess(model, share=0.25, name="test-prefill")
    yield p
    p.close()


def test_the_child_computes_exactly_the_cache_the_model_computes_here(model, process):
    for seed, length in ((1, 300), (2, 1), (3, 77)):
        prefix = make_history(length, SMALL, seed=seed)
        kv, cpu_ms, wall_ms = process.prefill(prefix)
        here = model.prefill(prefix)
        assert torch.equal(kv.kv, here.kv)
        assert (kv.length, kv.model_version, kv.edit_hash) == (here.length, here.model_version, here.edit_hash)
        assert cpu_ms >= 0 and wall_ms > 0


def test_an_edit_crosses_once_and_is_applied_in_the_child(model, process):
    policy = parse_policy({"editing": random_edit(SMALL, seed=5, scope="all")})
    edit = model.edit_from(policy.editing)
    prefix = make_history(120, SMALL, seed=4)
    kv, _, _ = process.prefill(prefix, edit)
    here = model.prefill(prefix, edit)
    assert kv.edit_hash == edit.content_hash != "none"
    assert torch.equal(kv.kv, here.kv)
    assert not torch.equal(kv.kv, model.prefill(prefix).kv)  # the edit changed the prefix's K/V
    again, _, _ = process.prefill(prefix, edit)  # the child kept it
    assert torch.equal(again.kv, here.kv)


def test_a_child_that_dies_fails_its_prefill_and_is_replaced_at_the_next(process):
    prefix = make_history(50, SMALL, seed=6)
    process.prefill(prefix)
    first = process.pid
    os.kill(first, signal.SIGKILL)
    with pytest.raises(PrefillProcessError, match="ended"):
        process.prefill(prefix)
    kv, _, _ = process.prefill(prefix)
    assert process.pid != first and kv.length == 50


@LINUX_PRIORITIES
def test_the_share_is_the_childs_nice_and_a_larger_one_starts_a_fresh_child(process):
    prefix = make_history(20, SMALL, seed=7)
    process.prefill(prefix)
    pid = process.pid
    assert os.getpriority(os.PRIO_PROCESS, pid) == nice_for_share(0.25)
    process.set_share(0.1)  # a higher nice: set on the running child
    assert process.pid == pid and os.getpriority(os.PRIO_PROCESS, pid) == nice_for_share(0.1)
    process.set_share(0.5)  # a lower nice cannot be set on it: the next prefill has a fresh child
    process.prefill(prefix)
    assert process.pid != pid and os.getpriority(os.PRIO_PROCESS, process.pid) == 0


def test_while_ranking_runs_the_child_keeps_to_its_share(process):
    prefix = make_history(600, SMALL, seed=8)
    process.prefill(prefix)  # started
    process.ranking_active.value = 1  # as the engine's gate writes it while a rank runs
    try:
        _, cpu_ms, wall_ms = process.prefill(prefix)
    finally:
        process.ranking_active.value = 0
    # It paused at its yield points until its CPU over the wall time was back to the share (a
    # loaded machine only lengthens the wall time); the last step's share is not paused for.
    assert wall_ms >= 0.6 * cpu_ms / 0.25


def test_an_engine_with_a_prefill_process_serves_the_same_scores():
    policy = parse_policy({"trigger": {"at_risk_seq_len": 100}})
    model = HSTUModel(SMALL, "cpu")
    engine = RelayEngine(model=model, device="cpu", policy=policy, prefill_process=True)
    plain = RelayEngine(model=HSTUModel(SMALL, "cpu"), device="cpu", policy=policy)
    prefix = make_history(300, SMALL, seed=9)
    try:
        assert engine.submit_pre_infer(PreInferRequest("ann", prefix)).admitted
        deadline = time.monotonic() + 60
        while engine.stats().counters["preinfer_completed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        result = engine.rank(RankRequest("ann", prefix, SHORT, CANDS))
        assert result.source == "hbm"
        assert plain.pre_infer(PreInferRequest("ann", prefix)).admitted
        assert result.scores == plain.rank(RankRequest("ann", prefix, SHORT, CANDS)).scores
        assert engine.forward_times.sums["prefill"]  # timed in the child, recorded here
        assert engine.ranking_gate.active == 0 and engine._prefill_process.ranking_active.value == 0
    finally:
        engine.close()
        plain.close()
    assert engine._prefill_process.pid is None  # closed with the engine


def test_a_prefill_process_is_only_for_a_cpu_model(model):
    class OnAnotherDevice:
        device = torch.device("meta")

    with pytest.raises(ValueError, match="CPU model"):
        PrefillProcess(OnAnotherDevice(), share=0.25)  # type: ignore[arg-type]


def test_weights_that_do_not_fit_the_shared_memory_keep_prefills_on_the_lane(model, monkeypatch, caplog):
    import relay_engine.core.prefill_process as pp

    monkeypatch.setattr(pp, "SHM_MARGIN", 1e12)  # no tmpfs has room for a trillion copies
    with pytest.raises(PrefillProcessError, match="shm_size"):
        pp.check_shared_memory(model)
    engine = RelayEngine(model=HSTUModel(SMALL, "cpu"), device="cpu", prefill_process=True)
    try:
        assert engine.prefill_where == "on the lane thread"
        assert "prefills stay on the lane thread" in caplog.text
    finally:
        engine.close()
