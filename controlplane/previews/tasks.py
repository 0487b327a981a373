"""The previews' Celery task, thin: it takes the preview's id and runs it (``services.preview_execute``).

Its name starts with ``relaygr.controlplane.preview``, which ``CELERY_TASK_ROUTES`` sends to the
``<prefix>.controlplane.previews`` queue: never an engine instance's queues.
"""

from __future__ import annotations

from controlplane.celery_app import app

from . import services


@app.task(name=services.PREVIEW_TASK, ignore_result=True)
def preview_run(preview_id: int) -> str:
    return services.preview_execute(preview_id=preview_id).status
