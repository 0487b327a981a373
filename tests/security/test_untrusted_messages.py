"""Celery messages in Redis are data, never code: the control plane's workers (previews, the canary
bake) refuse a pickled task unread on every queue they consume, as the engine instances do
(``tests/workers/test_pool.py``); nothing planted runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from celery import Celery
from django.conf import settings

from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.wire import CONTROLPLANE_QUEUES, controlplane_queue
from tests.security.payloads import CreatesFileWhenUnpickled
from tests.workers.fleet import wait_for
from workers.stack import controlplane_worker_argv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REFUSED = "Received invalid task message: Refusing to deserialize untrusted content of type pickle"


def test_the_control_plane_workers_refuse_pickled_tasks_unread(redis_url, key_prefix, tmp_path):
    """Each of the control plane's workers (one per queue: the bake's, the previews') gets a pickled task
    whose loading would create a file: each refuses it unread and keeps running."""
    marker = tmp_path / "unpickled"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test", "REDIS_URL": redis_url,
           "RELAYGR_KEY_PREFIX": key_prefix, "DATABASE_URL": f"sqlite:///{tmp_path / 'controlplane.sqlite3'}"}
    assert {queue.name.split(".controlplane.", 1)[1] for queue in settings.CELERY_TASK_QUEUES} == set(CONTROLPLANE_QUEUES)
    workers, logs = {}, {}
    for queue in CONTROLPLANE_QUEUES:
        logs[queue] = tmp_path / f"controlplane-{queue}.log"
        with logs[queue].open("w") as log:
            workers[queue] = subprocess.Popen(controlplane_worker_argv(sys.executable, tmp_path, queue, key_prefix),
                                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              process_group=0, preexec_fn=die_with_parent())
    sender = Celery("attacker", broker=redis_url, set_as_current=False)
    try:
        for queue in CONTROLPLANE_QUEUES:
            sender.send_task("relaygr.controlplane.rollouts_evaluate", args=[CreatesFileWhenUnpickled(marker)],
                             queue=controlplane_queue(queue, key_prefix), serializer="pickle")
        wait_for(lambda: all(REFUSED in logs[q].read_text() or workers[q].poll() is not None for q in workers),
                 180.0, interval_s=0.2, what="each control-plane worker to refuse its pickle")
        for queue, worker in workers.items():
            assert worker.poll() is None, logs[queue].read_text()[-3000:]
        assert not marker.exists()
    finally:
        sender.close()
        for worker in workers.values():
            os.killpg(worker.pid, signal.SIGTERM)
        for worker in workers.values():
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
