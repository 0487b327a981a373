"""Debian's ``promtool`` and ``prometheus`` (package ``prometheus``, installed by ``make promtool``) for
the tests of the exposition, the shipped rules and the dashboards. Absent, a test skips on a developer's
machine and fails under CI, where the set-up installs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def prometheus_binary(name: str) -> str:
    """The path of ``promtool`` or ``prometheus``; skips (fails under CI=true) when it is not installed."""
    path = shutil.which(name)
    if path is None:
        message = f"{name} is missing: `make promtool` (Debian: apt-get install prometheus)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI=true, where the set-up must have installed it")
        pytest.skip(message)
    return path


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([prometheus_binary("promtool"), *args], input=stdin, capture_output=True, timeout=120,
                          check=False)
