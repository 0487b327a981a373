"""The client when Redis is down as it starts: every caller gets a clear error by its own deadline —
none spins, none waits for another caller's read of the member list, none waits forever."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from workers.client import RelayClient, RelayError, RelayUnavailable
from workers.settings import Settings

CALLERS = 8
BUDGET_S = 0.2
# Scheduling slack on a loaded 2-core machine (a fresh clone's suite beside other work): generous, and
# still far below what a caller stuck behind another's read takes — the Redis client's timeouts, one
# per caller ahead of it (seconds each), or the test's own timeout for one waiting forever.
SLACK_S = 1.5


@pytest.fixture(params=["nothing listening", "a server that never answers"])
def dead_redis_url(request):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    if request.param == "nothing listening":
        listener.close()
        yield f"redis://127.0.0.1:{port}/0"
        return
    listener.listen(64)  # the kernel completes connections; nothing ever reads or answers them
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        listener.close()


def outcome(call) -> tuple[str, float]:
    started = time.monotonic()
    try:
        call()
    except RelayError as exc:
        return type(exc).__name__ if isinstance(exc, RelayUnavailable) else f"unexpected {exc!r}", \
            time.monotonic() - started
    return "answered", time.monotonic() - started


def test_concurrent_callers_each_fail_clearly_by_their_deadline(dead_redis_url):
    settings = Settings.from_env({}, redis_url=dead_redis_url, key_prefix=f"test-{uuid.uuid4().hex[:8]}",
                                 pool="down")
    client = RelayClient(settings)
    barrier = threading.Barrier(CALLERS)

    def rank(i: int) -> tuple[str, float]:
        barrier.wait(10)
        return outcome(lambda: client.rank(f"user-{i}", seq_len=8, short_len=1, n_candidates=2,
                                           deadline_s=time.time() + BUDGET_S))

    try:
        with ThreadPoolExecutor(CALLERS) as threads:
            results = list(threads.map(rank, range(CALLERS), timeout=30))
    finally:
        client.close()
    assert len(results) == CALLERS
    assert {kind for kind, _ in results} == {"NoLiveInstances"}, results
    assert max(elapsed for _, elapsed in results) <= BUDGET_S + SLACK_S, results


def test_a_pre_infer_signal_without_a_deadline_fails_clearly_within_the_default_wait(dead_redis_url):
    settings = Settings.from_env({}, redis_url=dead_redis_url, key_prefix=f"test-{uuid.uuid4().hex[:8]}",
                                 pool="down")
    with RelayClient(settings) as client:
        kind, elapsed = outcome(lambda: client.pre_infer("user", seq_len=8))
    assert kind == "NoLiveInstances" and elapsed <= 1.0 + SLACK_S


def test_a_channel_closed_under_a_send_by_kombus_reconnect_is_redis_unavailable_and_our_own_bugs_are_not():
    """kombu closes a pooled channel (``connection`` → None) while recovering from a lost Redis; a send
    on it raised AttributeError from inside kombu, which the caller saw as a bug (the fault tests, once)."""
    from kombu.transport.redis import Channel

    from workers.client import _sending

    closed = Channel.__new__(Channel)
    closed.connection = None
    with pytest.raises(RelayUnavailable, match="cannot send to test.0: Redis cannot be reached"), _sending("test.0"):
        closed._connparams()
    with pytest.raises(AttributeError), _sending("test.0"):
        None.client  # noqa: B018 — an AttributeError of our own stays one
