"""The pre-infer signal list on a real Redis: what a send leaves there, and what the reader takes from it."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import redis

from relay_engine.core.wire import PoolKeys
from tests.workers.fleet import wait_for
from workers import signals


@pytest.fixture
def keys_and_redis(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = PoolKeys("sig", prefix=f"test-{uuid.uuid4().hex[:8]}")
    yield keys, client
    client.delete(keys.preinfer_signals("sig.0"))
    client.close()


def test_a_send_appends_one_entry_that_expires_and_the_list_keeps_only_the_newest(keys_and_redis, monkeypatch):
    keys, client = keys_and_redis
    key = keys.preinfer_signals("sig.0")
    signals.send(client, keys, "sig.0", {"user_id": "u", "seq_len": 8})
    assert signals.decode(client.lindex(key, 0))[0] == {"user_id": "u", "seq_len": 8}
    assert 0 < client.ttl(key) <= signals.LIST_TTL_S
    monkeypatch.setattr(signals, "MAX_QUEUED", 5)
    for i in range(8):
        signals.send(client, keys, "sig.0", {"user_id": f"u{i}", "seq_len": 8})
    assert [signals.decode(raw)[0]["user_id"] for raw in client.lrange(key, 0, -1)] == [f"u{i}" for i in range(3, 8)]


@pytest.mark.parametrize("raw", ["", "not json", "[1]", '{"p": 1, "t": 1}', '{"p": {}}', '{"p": {}, "t": "now"}',
                                 '{"p": {}, "t": true}', '{"p": {}, "t": NaN}', "[" * 100_000])
def test_an_entry_that_is_not_ours_decodes_to_nothing(raw):
    assert signals.decode(raw)[0] is None


def test_the_reader_takes_batches_in_order_and_drops_what_is_too_old_or_refused(keys_and_redis):
    keys, client = keys_and_redis
    key = keys.preinfer_signals("sig.0")
    now = 1_000_000.0
    handled = []
    reader = signals.SignalConsumer(client, key, lambda p, _: handled.append(p["user_id"]) or
                                    ({"ok": False} if p["user_id"] == "refused" else {"ok": True}), clock=lambda: now)
    client.rpush(key, *(signals.entry({"user_id": f"u{i}"}, sent_s=now - 0.5) for i in range(100)))
    client.rpush(key, signals.entry({"user_id": "old"}, sent_s=now - signals.SIGNAL_TTL_S - 0.1), "junk",
                 signals.entry({"user_id": "refused"}, sent_s=now))
    first = reader.take(block_s=0.1)
    assert len(first) == signals.BATCH
    reader.process(first)
    reader.process(reader.take(block_s=0.1))
    assert reader.take(block_s=0.1) == []
    assert handled == [f"u{i}" for i in range(100)] + ["refused"]
    assert (reader.handled, reader.expired, reader.invalid) == (100, 1, 2)


def test_the_reader_thread_handles_signals_as_they_come_and_stops_promptly(keys_and_redis):
    keys, client = keys_and_redis
    key = keys.preinfer_signals("sig.0")
    seen, lock = [], threading.Lock()

    def handle(payload, sent_s):
        assert abs(sent_s - time.time()) < 5
        with lock:
            seen.append(payload["user_id"])
        if payload["user_id"] == "boom":
            raise RuntimeError("a bug in one handler")

    reader = signals.SignalConsumer(client, key, handle).start()
    try:
        signals.send(client, keys, "sig.0", {"user_id": "boom"})
        wait_for(lambda: seen == ["boom"], 5.0, what="the first signal")
        signals.send(client, keys, "sig.0", {"user_id": "after"})
        wait_for(lambda: seen == ["boom", "after"], 5.0, what="a signal after a handler raised")
    finally:
        started = time.monotonic()
        reader.stop()
    assert time.monotonic() - started < signals.BLOCK_S + 1
    assert not reader._thread.is_alive()


def test_the_reader_yields_to_ranking_before_each_signal(keys_and_redis):
    keys, client = keys_and_redis
    now = 1_000_000.0
    order = []
    reader = signals.SignalConsumer(client, keys.preinfer_signals("sig.0"),
                                    lambda p, _: order.append(p["user_id"]), clock=lambda: now,
                                    yield_point=lambda: order.append("yield"))
    reader.process([signals.entry({"user_id": f"u{i}"}, sent_s=now) for i in range(3)])
    assert order == ["yield", "u0", "yield", "u1", "yield", "u2"]
