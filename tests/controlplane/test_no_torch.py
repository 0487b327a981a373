"""The control plane serves without torch: every page and API view (the URLconf, which Django loads on a
process's first request) and the Celery app import without it. Importing the model through the
forward-times record once cost that first request 2.4 s; only the lab's command-line tools load it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_control_planes_requests_never_load_torch():
    code = ("import os, sys; os.environ['DJANGO_SETTINGS_MODULE'] = 'controlplane.settings.test'; "
            "import django; django.setup(); from django.urls import get_resolver; get_resolver().url_patterns; "
            "import controlplane.celery_app; "
            "print(sorted(m for m in ('torch', 'relay_engine.core.model') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
