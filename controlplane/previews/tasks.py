"""The previews' Celery tasks, thin: run a preview (``services.preview_execute``), and the beat's
pass over the scorecard (``scoring.score_tick``).

``relaygr.controlplane.preview*`` is sent by ``CELERY_TASK_ROUTES`` to the
``<prefix>.controlplane.previews`` queue: never an engine instance's queues. The scorecard's task
(``relaygr.controlplane.score_previews``, a few reads) stays on the periodic queue with the beat.
"""

from __future__ import annotations

from controlplane.celery_app import app

from . import scoring, services


@app.task(name=services.PREVIEW_TASK, ignore_result=True)
def preview_run(preview_id: int) -> str:
    return services.preview_execute(preview_id=preview_id).status


@app.task(name=scoring.SCORE_TASK, ignore_result=True)
def score_previews() -> dict[str, int]:
    return scoring.score_tick()
