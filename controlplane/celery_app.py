"""The control plane's own Celery app: work that must not run inside a web request.

    celery -A controlplane.celery_app worker --queues <prefix>.controlplane.periodic --beat \\
        --pool threads --concurrency 2 --schedule var/celerybeat-schedule
    celery -A controlplane.celery_app worker --queues <prefix>.controlplane.previews \\
        --pool threads --concurrency 2

It has two queues (``CELERY_TASK_QUEUES`` in the settings, named by ``wire.controlplane_queue``), both
under the deployment's key prefix and apart from every engine instance's queues
(``<prefix>.<pool>.<index>.rank`` / ``.preinfer``), so a long job here can never hold a ranking
request and a burst of rankings can never starve a job here; each is consumed by a worker process of
its own, so a preview never holds the bake:

- ``<prefix>.controlplane.periodic``: the beat's periodic tasks (the canary bake evaluation, which
  expires unless run within its interval);
- ``<prefix>.controlplane.previews``: what-if previews (a captured traffic window replayed through
  the fleet simulator, seconds to a minute each), bounded per pool and per user
  (``previews.services``).

The broker is ``REDIS_URL``, the Redis the workers meet the control plane in. There is no result
backend: every task writes its outcome to the database, where the API reads it.

Run ``--beat`` in exactly one process of a deployment, the periodic queue's worker (``make run``,
``workers.stack.controlplane_worker_argv``, and the compose file do): beat is the single clock of
the periodic tasks.
"""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings.dev")

app = Celery("relaygr-controlplane", set_as_current=False)
# CELERY_* settings of Django (controlplane/settings/base.py) configure the app.
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
