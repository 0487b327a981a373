"""The benchmark's modes: the disk ablation is measured beside the same small DRAM without the disk,
and ``--modes`` picks a paired subset (baseline and relay always in)."""

from __future__ import annotations

import argparse

import pytest

from relay_engine.core.config import parse_policy
from relay_engine.lab.bench.cli import main, modes_flag, with_required
from relay_engine.lab.bench.modes import MODES, MODES_BY_NAME, Regime, mode_policy, served_policy


def test_relay_disk_differs_from_relay_small_dram_only_by_the_disk_tier():
    regime = Regime(slo_ms=50, deadline_ms=100, dram_budget_mb=800, disk_path="/tmp/relaygr-test-disk",
                    disk_budget_mb=800)
    small = mode_policy(MODES_BY_NAME["relay_small_dram"], regime)
    disk = mode_policy(MODES_BY_NAME["relay_disk"], regime)
    relay = mode_policy(MODES_BY_NAME["relay"], regime)
    assert small.cache.dram_budget_mb == disk.cache.dram_budget_mb == 100 < relay.cache.dram_budget_mb
    assert small.cache.disk is None and relay.cache.disk is None
    assert disk.cache.disk.path == "/tmp/relaygr-test-disk" and disk.cache.disk.budget_mb == 800
    assert disk.trigger == small.trigger
    assert disk.cache.disk.ttl_ms == disk.cache.dram_ttl_ms


def test_modes_flag_keeps_the_benchmark_order_and_a_full_run_always_measures_baseline_and_relay():
    chosen = modes_flag("relay_disk,relay_small_dram")
    assert [m.name for m in chosen] == ["relay_small_dram", "relay_disk"]  # --throughput-only runs just these
    assert [m.name for m in with_required(chosen)] == ["baseline", "relay", "relay_small_dram", "relay_disk"]
    assert modes_flag(",".join(m.name for m in MODES)) == MODES


@pytest.mark.parametrize("text", ["relay_dsk", "", ","])
def test_modes_flag_names_the_unknown_mode_and_the_choices(text):
    with pytest.raises(argparse.ArgumentTypeError, match="choose from baseline, relay"):
        modes_flag(text)


def test_fleet_flag_rejects_an_unknown_fleet_naming_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--fleet", "prod"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--fleet" in err and "unknown fleet 'prod'" in err and "choose lab" in err and "or both" in err


def test_every_mode_is_a_policy_the_workers_accept_and_the_baseline_keeps_no_cache():
    regime = Regime(slo_ms=50.0, deadline_ms=100.0)
    for mode in MODES:
        policy = served_policy(mode, regime)
        assert parse_policy(policy.to_dict()) == policy, mode.name  # what a worker's reconciler applies
    baseline = served_policy(MODES_BY_NAME["baseline"], regime)
    assert not baseline.cache.enabled and baseline.trigger.max_preinfer_inflight == 0
    assert served_policy(MODES_BY_NAME["relay"], regime).cache.enabled
