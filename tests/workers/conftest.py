"""Fixtures of the worker tests: a pool of real worker processes on the real Redis, shared by the
modules of this package (starting one costs seconds); tests that break a pool start their own."""

from __future__ import annotations

import pytest

from tests.workers.fleet import Fleet


@pytest.fixture(scope="package")
def fleet(redis_url, tmp_path_factory):
    pool = Fleet(redis_url, tmp_path_factory.mktemp("fleet-logs"), size=2)
    try:
        yield pool.start()
    finally:
        pool.stop()
