"""The arithmetic floors of ``make profile --floors``: FLOPs counted on the real forwards, the roofline's
arithmetic, and the table. Invariants only, never timings."""

from __future__ import annotations

import pytest
import torch

from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel, ModelConfig
from relay_engine.lab import floors
from relay_engine.lab.profile import floor_rows, main

SMALL = ModelConfig(num_items=1024, embed_dim=32, num_layers=2, num_heads=2, head_dim=16, max_seq_len=1024)


def test_the_flop_counter_sees_a_matmul_as_2mnk():
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert floors.matmul_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_a_longer_prefix_costs_more_flops_and_the_cached_rank_fewer_than_the_full_one():
    model = HSTUModel(SMALL, torch.device("cpu"))
    roofline = floors.Roofline(matmul_flops_per_s=1e9, bytes_per_s=1e9, device="cpu", threads=1)
    rows = {(r.op, r.tokens): r for r in floor_rows(model, SyntheticFeatures(SMALL), [64, 256], 8, 16, 1, roofline)}
    assert rows["prefill", 256].flops > rows["prefill", 64].flops > 0
    for n in (64, 256):
        assert 0 < rows["rank", n].flops < rows["rank_full", n].flops
        # the cached rank reads the KV that the prefill wrote: the same bytes beyond the weights
        assert rows["rank", n].nbytes == rows["prefill", n].nbytes > rows["rank_full", n].nbytes
        assert all(r.measured_ms > 0 for r in rows.values())


def test_the_floor_is_the_slower_of_compute_and_memory():
    roofline = floors.Roofline(matmul_flops_per_s=1e9, bytes_per_s=1e8, device="cpu", threads=1)
    row = floors.floor_row("rank", 8, lambda: torch.randn(4, 4) @ torch.randn(4, 4), 10**6, roofline, 20.0)
    assert row.memory_ms == 10.0 and row.compute_ms < row.memory_ms
    assert (row.floor_ms, row.bound_by, row.times_floor) == (10.0, "memory", 2.0)
    assert "| rank | 8 |" in floors.markdown([row], roofline)


def test_floors_and_fit_are_separate_runs(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--floors", "--fit", "--out", "x.json"])
    assert exc.value.code == 2
    assert "--floors and --fit" in capsys.readouterr().err


def test_the_gemms_of_a_forward_are_recorded_with_their_layouts_and_replay_at_the_same_shapes():
    a, b = torch.randn(3, 8, 4), torch.randn(3, 16, 4).transpose(1, 2)  # b: a transposed view, as k.transpose
    c = torch.randn(3, 8, 16)
    calls = floors.gemm_calls(lambda: (torch.bmm(a, b).add_(1), c.baddbmm_(a, b), torch.randn(2, 2) @ torch.randn(2, 2)))
    assert [call.op.overloadpacket for call in calls] == [torch.ops.aten.bmm, torch.ops.aten.baddbmm_, torch.ops.aten.mm]
    assert calls[0].args[1] == (b.size(), b.stride())  # the transposed layout, not a contiguous copy
    assert calls[0].replay(torch.device("cpu"))().shape == (3, 8, 16)
    assert floors.gemms_alone_ms(calls, torch.device("cpu"), repeats=1) > 0
