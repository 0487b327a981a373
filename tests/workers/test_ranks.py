"""Ranking requests on the instance's own Redis list (``workers.ranks``): what a send leaves there, what a
real instance does with entries that are late, not ours, or sent the old way through Celery."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid

import pytest
import redis

from relay_engine.core.wire import PoolKeys
from tests.workers.fleet import wait_for
from tests.workers.test_pool import SMALL, latest_snapshot
from workers import ranks
from workers.client import RankDeadlineExceeded, RankError, RelayClient, ReplyList


def test_a_send_appends_one_entry_that_expires(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = PoolKeys("rk", prefix=f"test-{uuid.uuid4().hex[:8]}")
    key = keys.rank_requests("rk.0")
    try:
        ranks.send(client, keys, "rk.0", {"user_id": "u"}, keys.reply("t"), 123.5, sent_s=100.0)
        assert ranks.decode(client.lindex(key, 0))[0] == {"p": {"user_id": "u"}, "r": keys.reply("t"), "d": 123.5,
                                                          "t": 100.0}
        assert 0 < client.ttl(key) <= ranks.LIST_TTL_S
    finally:
        client.delete(key)
        client.close()


@pytest.mark.parametrize("raw", ["", "not json", "[1]", '{"p": {}}', '{"p": {}, "r": 1, "d": 5}',
                                 '{"p": {}, "r": "k"}', '{"p": {}, "r": "k", "d": "soon"}',
                                 '{"p": {}, "r": "k", "d": true}', '{"p": {}, "r": "k", "d": Infinity}',
                                 '{"r": "k", "d": 5}', "[" * 100_000])
def test_an_entry_that_is_not_ours_decodes_to_nothing(raw):
    assert ranks.decode(raw)[0] is None



@pytest.mark.integration
def test_a_request_that_queued_past_its_deadline_is_answered_at_once_and_counted_not_run(fleet):
    name = fleet.names[0]
    before = latest_snapshot(fleet, name).counters["rank_deadline_exceeded"]
    reply = ReplyList(fleet.client.replies, fleet.keys.reply(uuid.uuid4().hex))
    ranks.send(fleet.redis, fleet.keys, name, {"user_id": "late", "deadline_s": time.time() - 1, **SMALL},
               reply.key, time.time() - 1)
    answer = reply.pop(5.0)
    assert (answer["ok"], answer["error"], answer["expired_in_queue"]) == (False, "deadline_exceeded", True)
    assert "expired in" in answer["message"]
    wait_for(lambda: latest_snapshot(fleet, name).counters["rank_deadline_exceeded"] > before, 3.0,
             what="the expired request counted as a deadline error")


@pytest.mark.integration
def test_entries_that_are_not_ours_are_answered_where_they_can_be_and_the_instance_serves_on(fleet):
    name = fleet.names[0]
    reply = ReplyList(fleet.client.replies, fleet.keys.reply(uuid.uuid4().hex))
    key = fleet.keys.rank_requests(name)
    fleet.redis.rpush(key, "not json", "[" * 50_000, json.dumps({"p": {}, "r": "elsewhere:reply:x", "d": "soon"}),
                      json.dumps({"p": {"user_id": "u"}, "r": reply.key}))  # no deadline: answered as not ours
    answer = reply.pop(5.0)
    assert (answer["ok"], answer["error"]) == (False, "invalid_input") and "not a ranking request" in answer["message"]
    assert fleet.redis.exists("elsewhere:reply:x") == 0  # a key outside the pool's replies is never written
    with pytest.raises(RankError) as caught:  # a payload the engine refuses: the field named, as through Celery
        fleet.client.send_rank({"user_id": "u", "deadline_s": time.time() + 5, **SMALL, "seq_len": -1},
                               instance=name).wait()
    assert caught.value.field == "seq_len"
    served = fleet.client.send_rank({"user_id": "after-junk", "deadline_s": time.time() + 5, **SMALL},
                                    instance=name).wait()
    assert served.instance == name and fleet.procs[name].poll() is None
    assert set(served.legs_ms) == {"to_worker", "in_worker", "back"}


@pytest.mark.integration
def test_the_celery_task_still_ranks_for_senders_of_the_celery_protocol(fleet):
    """A client of the previous release (or RELAYGR_RANK_TRANSPORT=celery) during a rolling upgrade."""
    with RelayClient(dataclasses.replace(fleet.settings, rank_transport="celery")) as old:
        old.refresh()
        reply = old.rank("celery-user", deadline_s=time.time() + 5, **SMALL)
        assert reply.instance in fleet.names and reply.legs_ms is not None
        with pytest.raises(RankDeadlineExceeded):
            old.rank("celery-late", deadline_s=time.time() + 0.005, **{**SMALL, "seq_len": 3000})
    assert fleet.redis.llen(fleet.keys.rank_requests(reply.instance)) == 0  # nothing went on the request list
