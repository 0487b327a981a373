"""The canary bake's periodic task (beat, every ``RELAYGR_ROLLOUT_EVAL_S``), on the control plane's
periodic queue. Thin: the state is in the database and the pass is ``services.rollouts_tick``, so a
restarted worker simply resumes every bake on its next tick."""

from __future__ import annotations

from controlplane.celery_app import app

from . import services

EVALUATE_TASK = "relaygr.controlplane.rollouts_evaluate"


@app.task(name=EVALUATE_TASK, ignore_result=True)
def rollouts_evaluate() -> dict[str, int]:
    return services.rollouts_tick()
