"""A process the tests start in the background and read later (tests/deploy/conftest.py's Prometheus
benchmark, tests/lab/smoke_runs.py's bench smoke)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from relay_engine.core.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[1]


class BackgroundRun:
    """``python -m module args`` started now in the repository, its output kept in files in ``folder`` (a
    pipe nobody reads would stall it); it dies with the test session."""

    def __init__(self, folder: Path, module: str, *args: str, timeout_s: float, env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", module, *args]
        self.timeout_s = timeout_s
        self.stdout, self.stderr = folder / "stdout.txt", folder / "stderr.txt"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.process = subprocess.Popen(self.args, cwd=REPO, env=env, stdout=out, stderr=err, text=True,
                                            preexec_fn=die_with_parent())

    def result(self) -> subprocess.CompletedProcess:
        self.process.wait(timeout=self.timeout_s)
        return subprocess.CompletedProcess(self.args, self.process.returncode, self.stdout.read_text(),
                                           self.stderr.read_text())

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
