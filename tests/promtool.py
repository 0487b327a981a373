"""Debian's ``promtool`` (package ``prometheus``, installed by ``make promtool``) for the tests of the
exposition and of the shipped rules. Absent, a test skips on a developer's machine and fails under CI,
where the set-up installs it."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def promtool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    path = shutil.which("promtool")
    if path is None:
        message = "promtool is missing: `make promtool` (Debian: apt-get install prometheus)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI=true, where the set-up must have installed it")
        pytest.skip(message)
    return subprocess.run([path, *args], input=stdin, capture_output=True, timeout=120, check=False)
