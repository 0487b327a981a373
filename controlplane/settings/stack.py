"""The embedded default (``make run``, ``python -m workers.stack``): the dev settings, without debug pages.

Django's debug page shows the settings and the stack of every error to whoever caused it, so DEBUG is
off unless ``RELAYGR_DEBUG=1``, which the stack sets only for ``--debug`` on a loopback ``--host``. A
500 is then the plain JSON error naming its request id (``controlplane.urls.server_error``).
``DJANGO_ALLOWED_HOSTS`` (comma-separated; the stack fits it to its bind address) and
``DJANGO_SECRET_KEY`` (the stack keeps one per data directory) replace the dev values when set.
"""

import os

from .dev import *  # noqa: F403
from .dev import ALLOWED_HOSTS as _DEV_HOSTS
from .dev import SECRET_KEY as _DEV_SECRET_KEY

DEBUG = os.environ.get("RELAYGR_DEBUG") == "1"
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "").split(",") if h.strip()] or _DEV_HOSTS
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or _DEV_SECRET_KEY
