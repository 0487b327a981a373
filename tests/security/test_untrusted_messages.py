"""Celery messages in Redis are data, never code: the control plane's worker (previews, the canary
bake) refuses a pickled task unread on every queue it consumes, as the engine instances do
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

from tests.security.payloads import CreatesFileWhenUnpickled
from tests.workers.fleet import wait_for
from workers.stack import controlplane_worker_argv

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
REFUSED = "Received invalid task message: Refusing to deserialize untrusted content of type pickle"


def test_the_control_plane_worker_refuses_pickled_tasks_unread(redis_url, key_prefix, tmp_path):
    marker = tmp_path / "unpickled"
    log_path = tmp_path / "controlplane-worker.log"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings.test", "REDIS_URL": redis_url,
           "RELAYGR_KEY_PREFIX": key_prefix, "DATABASE_URL": f"sqlite:///{tmp_path / 'controlplane.sqlite3'}"}
    # Its queues, <prefix>.controlplane.<name>, under this test's prefix.
    queues = [f"{key_prefix}.controlplane.{queue.name.split('.controlplane.', 1)[1]}"
              for queue in settings.CELERY_TASK_QUEUES]
    with log_path.open("w") as log:
        worker = subprocess.Popen(controlplane_worker_argv(sys.executable, tmp_path), cwd=REPO, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, process_group=0)
    sender = Celery("attacker", broker=redis_url, set_as_current=False)
    try:
        for queue in queues:
            sender.send_task("relaygr.controlplane.rollouts_evaluate", args=[CreatesFileWhenUnpickled(marker)],
                             queue=queue, serializer="pickle")
        wait_for(lambda: log_path.read_text().count(REFUSED) == len(queues) or worker.poll() is not None, 180.0,
                 interval_s=0.2, what="the control plane's worker to refuse every pickle")
        assert worker.poll() is None, log_path.read_text()[-3000:]
        assert not marker.exists()
    finally:
        sender.close()
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
