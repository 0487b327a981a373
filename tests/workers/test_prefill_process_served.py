"""An instance with ``RELAYGR_PREFILL_PROCESS=on``, through real workers: a pre-inferred prefix,
computed in the instance's prefill process under a published edit, serves the local model's scores."""

from __future__ import annotations

import dataclasses
import time

from tests.workers.fleet import Fleet, wait_for
from tests.workers.test_editing_served import (
    CONVERGE_S,
    REQUEST,
    acked,
    assert_close,
    edit_spec,
    local_scores,
)


def test_a_prefill_process_serves_pre_inferred_prefixes_under_an_edit(redis_url, tmp_path):
    fleet = Fleet(redis_url, tmp_path, pool="prefillproc", size=1)
    fleet.settings = dataclasses.replace(fleet.settings, prefill_process="on")
    fleet.start()
    try:
        spec = edit_spec(alpha=2.5, scope="all", seed=3)  # the edit changes the prefix's K/V too
        generation = fleet.publish(spec)
        wait_for(lambda: acked(fleet, generation), CONVERGE_S, what=f"ACK of generation {generation}")
        (name,) = fleet.names
        assert "prefills in a child process" in fleet.log_tail(name, 200)
        def hbm_bytes() -> int:
            return fleet.status(name).tiers["hbm"]["bytes"]

        for i, user in enumerate(("pp-a", "pp-b", "pp-c")):
            before = hbm_bytes()
            fleet.client.pre_infer(user, seq_len=REQUEST["seq_len"])
            # Ranked only once the instance holds the prefix: a miss would keep one of its own.
            wait_for(lambda before=before: hbm_bytes() > before, 30, what=f"{user}'s pre-inferred prefix in HBM")
            reply = fleet.client.rank(user, query_index=1 + i, deadline_s=time.time() + 10, **REQUEST)
            # The prefix's bytes are counted once it is admitted: the ranking may come while the prefill
            # process is still at it, and then joins it (``inflight``) rather than computing its own.
            assert reply.source in ("hbm", "inflight")
            assert_close(reply.scores, local_scores(spec, user, 1 + i))
    finally:
        fleet.stop()
