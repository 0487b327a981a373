"""The bench smoke's runs (tests/lab/test_bench_smoke.py): the benchmark, the simulator's run and its validation
over one shared trace, each a process of its own started at once, its output kept in files.

They are started together at their first use (``bench_smoke_runs``, tests/conftest.py): where the history test
of tests/deploy runs in the same session, beside it (tests/deploy/conftest.py), since that one mostly waits on
the clock; else as the smoke's first test asks. Each replays in real time and leaves the cores idle much of the
while, and none of what the smoke asks of them depends on how fast it ran."""

from __future__ import annotations

from pathlib import Path

from tests.background import BackgroundRun

MODULE = "test_bench_smoke.py"
RUN_TIMEOUT_S = 280


# Each test's run over the shared trace: its command's arguments after the trace, given its output file.
RUNS = {
    "test_quick_run_writes_every_mode_the_ratios_with_intervals_a_table_and_plots":
        lambda trace, out: ("relay_engine.bench", "--quick", "--trace", str(trace), "--out", str(out)),
    "test_the_simulator_replays_a_trace_per_mode_and_writes_its_figures":
        lambda trace, out: ("relay_engine.sim", "run", "--trace", str(trace), "--instances", "3",
                            "--modes", "baseline,relay,relay_cache_only", "--out", str(out)),
    "test_validation_reports_the_simulators_error_at_every_point":
        lambda trace, out: ("relay_engine.sim", "validate", "--quick", "--trace", str(trace), "--out", str(out)),
}


def selected(items) -> set[str]:
    """The names of the smoke's tests with a run among ``items`` (a deselected one starts nothing)."""
    return {item.name for item in items if item.path.name == MODULE and item.name in RUNS}


def start(items, tmp_path_factory) -> dict[str, tuple[BackgroundRun, Path]]:
    """The runs of the selected tests, all started now: test name → (its run, its output file)."""
    from relay_engine.core.trace import write_trace
    from relay_engine.lab.traffic import TraceSpec, generate_trace

    wanted = selected(items)
    running: dict[str, tuple[BackgroundRun, Path]] = {}
    if not wanted:
        return running
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    write_trace(trace, generate_trace(TraceSpec(queries=1500, seed=3)))
    try:
        for name, command in RUNS.items():
            if name in wanted:
                folder = tmp_path_factory.mktemp("run")
                out = folder / "out.json"
                running[name] = (BackgroundRun(folder, *command(trace, out), timeout_s=RUN_TIMEOUT_S), out)
    except BaseException:
        for run, _ in running.values():
            run.stop()
        raise
    return running
