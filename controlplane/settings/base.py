"""Settings shared by every environment. Nothing secret lives here."""

from __future__ import annotations

import os
import urllib.parse
from datetime import timedelta
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from kombu import Exchange, Queue

from controlplane.common.cache import redis_cache
from relay_engine.core import fields, wire

BASE_DIR = Path(__file__).resolve().parent.parent.parent

DEBUG = False
ALLOWED_HOSTS: list[str] = []

INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "axes",
    "controlplane.audit",
    "controlplane.accounts",
    "controlplane.policies",
    "controlplane.fleet",
    "controlplane.telemetry",
    "controlplane.rollouts",
    "controlplane.previews",
    "frontend",
]

MIDDLEWARE = [
    "controlplane.common.middleware.RequestIdMiddleware",
    "controlplane.common.middleware.BodySizeLimitMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a lock-out into its 429 answer
]

ROOT_URLCONF = "controlplane.urls"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "controlplane" / "templates"],  # the API docs' pages (api_docs/)
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# 12-factor: DATABASE_URL names any database (sqlite:///path, postgres://user:pw@host:5432/db);
# without it an embedded SQLite file next to manage.py needs no set-up.
DATABASES = {
    "default": dj_database_url.config(
        default=f"sqlite:///{BASE_DIR / 'db.sqlite3'}", conn_max_age=60, conn_health_checks=True
    )
}
# SQLite, the embedded default, made safe for concurrent writers (select_for_update does nothing on
# it): WAL lets readers run beside the one writer; IMMEDIATE makes every transaction take the write
# lock when it begins, so concurrent writers queue for up to SQLITE_BUSY_TIMEOUT_S instead of failing
# with "database is locked" when a reader upgrades; the loser of a race then reads the winner's
# commit and answers 409. PostgreSQL needs none of this (row locks do the same).
SQLITE_BUSY_TIMEOUT_S = 20
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": SQLITE_BUSY_TIMEOUT_S,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL",
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
# Whitenoise serves the installed apps' static files (Swagger UI and Redoc from the sidecar
# package) straight from the finders, so a deployment works without a CDN and even before
# collectstatic has run.
WHITENOISE_USE_FINDERS = True
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}

# Content-Security-Policy on every response (django-csp): scripts, styles,
# fonts, images and connections from this origin only, no inline script anywhere, no plugins, no
# framing. The pages keep their scripts in static files and plotly.js is served from here.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "font-src": ["'self'"],
        "connect-src": ["'self'"],
        "worker-src": ["'none'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    },
}

LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"

# Request bodies above this are refused with 413 before anything parses them. The largest
# legitimate body is a spec with editing directions (heads × head_dim floats): well under this.
RELAYGR_MAX_BODY_BYTES = int(os.environ.get("RELAYGR_MAX_BODY_BYTES", 2 * 1024 * 1024))
DATA_UPLOAD_MAX_MEMORY_SIZE = RELAYGR_MAX_BODY_BYTES

# Redis, where the control plane meets the workers. None: endpoints that need it answer 503
# naming the setting. The key prefix comes from RELAYGR_KEY_PREFIX via relay_engine.core.wire.
REDIS_URL = os.environ.get("REDIS_URL") or None


def _prometheus_url(raw: str | None) -> str | None:
    """PROMETHEUS_URL checked: empty is none, else an http(s) URL of a Prometheus server (no query)."""
    if not raw:
        return None
    try:
        parts = urllib.parse.urlsplit(raw)
        parts.port  # noqa: B018 - raises ValueError for a port out of range or not a number
    except ValueError as exc:
        raise ImproperlyConfigured(f"PROMETHEUS_URL {raw!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ImproperlyConfigured(f"PROMETHEUS_URL must be the http:// or https:// address of a Prometheus "
                                   f"server, without a query (e.g. http://prometheus:9090), got {raw!r}")
    return raw.rstrip("/")


# Prometheus, when one scrapes /metrics: telemetry windows longer than the live one are then read from
# it (controlplane.telemetry.sources), and the workers run with RELAYGR_HISTORY=prometheus. None: every
# window is read from Redis (the embedded default). A read waits at most PROMETHEUS_TIMEOUT_S.
PROMETHEUS_URL = _prometheus_url(os.environ.get("PROMETHEUS_URL"))
PROMETHEUS_TIMEOUT_S = 5.0

# The control plane's Celery app (controlplane/celery_app.py): the periodic bake evaluation and the
# previews run on queues of their own under the key prefix (``wire.controlplane_queue``), never on an
# engine instance's queues, each consumed by a worker process of its own (``-Q``), so previews
# never hold the bake. No result backend: tasks write their outcome to the database.
CELERY_BROKER_URL = REDIS_URL or "redis://127.0.0.1:6379/0"
CELERY_TASK_DEFAULT_QUEUE = wire.controlplane_queue("periodic")
CELERY_TASK_QUEUES = tuple(Queue(name, Exchange(name), routing_key=name)
                           for name in map(wire.controlplane_queue, wire.CONTROLPLANE_QUEUES))
CELERY_TASK_ROUTES = {"relaygr.controlplane.preview*": {"queue": wire.controlplane_queue("previews")}}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_timeout": 5.0, "socket_connect_timeout": 2.0}
# Periodic tasks (beat): filled in by the apps that own them.
# The canary bake's evaluation (controlplane.rollouts.tasks), every RELAYGR_ROLLOUT_EVAL_S seconds;
# a canary needs at least RELAYGR_ROLLOUT_MIN_REQUESTS requests to be rolled back early or promoted.
RELAYGR_ROLLOUT_EVAL_S = float(os.environ.get("RELAYGR_ROLLOUT_EVAL_S", "5"))
RELAYGR_ROLLOUT_MIN_REQUESTS = int(os.environ.get("RELAYGR_ROLLOUT_MIN_REQUESTS", "50"))
# The previews' scorecard (controlplane.previews.scoring): published previewed revisions measured,
# every RELAYGR_PREVIEW_SCORE_S seconds.
RELAYGR_PREVIEW_SCORE_S = float(os.environ.get("RELAYGR_PREVIEW_SCORE_S", "30"))
CELERY_BEAT_SCHEDULE: dict = {
    "rollouts-evaluate": {"task": "relaygr.controlplane.rollouts_evaluate", "schedule": RELAYGR_ROLLOUT_EVAL_S,
                          "options": {"expires": RELAYGR_ROLLOUT_EVAL_S}},
    "previews-score": {"task": "relaygr.controlplane.score_previews", "schedule": RELAYGR_PREVIEW_SCORE_S,
                       "options": {"expires": RELAYGR_PREVIEW_SCORE_S}},
}

# Decoded telemetry each web process keeps (controlplane.telemetry.cache): least recently used out
# past this many MiB. Pool views read the pool rollups in Redis; this holds the per-instance detail.
TELEMETRY_CACHE_MB = float(os.environ.get("RELAYGR_TELEMETRY_CACHE_MB", 64))

# Writes (POST/PUT/PATCH/DELETE) per authenticated user; uploads to the editor per user.
# What-if previews: the most recent requests of a window the simulator replays (0: its default,
# sized to finish a 15-minute window at 50 QPS within a minute).
RELAYGR_PREVIEW_MAX_REQUESTS = int(os.environ.get("RELAYGR_PREVIEW_MAX_REQUESTS", 0))
# A folder where each preview keeps what it replayed (its trace, specs, the pool's forward times, the
# captured records with what the instances measured, the simulator's command and result), one
# subfolder per preview, for ``python -m relay_engine.sim decompose`` to replay it request by request
# against the capture. Empty: nothing is kept.
RELAYGR_PREVIEW_KEEP_DIR = os.environ.get("RELAYGR_PREVIEW_KEEP_DIR", "")


def _env_int(name: str, default: int, lo: int, hi: int) -> int:
    try:
        return int(fields.number_text(os.environ.get(name) or str(default), lo, hi, as_int=True))
    except fields.FieldValueError as exc:
        raise ImproperlyConfigured(f"{name} {exc}") from None


# Previews queued or running at once (each a simulator run of seconds to a minute, two at a time on
# the previews' worker): per pool, and per user over every pool. One more is a 429 naming the limit
# and what is running; asking again for a preview already queued reuses it and counts nothing.
RELAYGR_PREVIEW_MAX_PER_POOL = _env_int("RELAYGR_PREVIEW_MAX_PER_POOL", 4, 1, 1000)
# The niceness previews' simulator runs at: background work, which must never take a core from the
# ranking of instances on the same host (make run's demo puts them on one; so may a small deployment).
RELAYGR_PREVIEW_NICE = _env_int("RELAYGR_PREVIEW_NICE", 19, 0, 19)
RELAYGR_PREVIEW_MAX_PER_USER = _env_int("RELAYGR_PREVIEW_MAX_PER_USER", 2, 1, 1000)

RELAYGR_WRITE_THROTTLE_RATE = os.environ.get("RELAYGR_WRITE_THROTTLE_RATE", "120/min")
RELAYGR_UPLOAD_THROTTLE_RATE = os.environ.get("RELAYGR_UPLOAD_THROTTLE_RATE", "30/min")

# The shared cache: throttle and log-in lock-out counters (and any read-side cache) live in Redis,
# so limits hold across gunicorn processes and machines. Keys carry the deployment's key prefix, as
# every key of the fleet does. Values are JSON, never pickles (controlplane/common/cache.py): Redis is
# untrusted input. Without Redis (a bare development set-up) a per-process memory cache stands in.
CACHES = {
    "default": redis_cache(REDIS_URL, f"{wire.key_prefix()}:django") if REDIS_URL
    else {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
}
# Celery, on both sides of the broker, takes JSON only: tasks, results, events, remote control.
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_ACCEPT_CONTENT = ["json"]
CELERY_TASK_SERIALIZER = CELERY_RESULT_SERIALIZER = CELERY_EVENT_SERIALIZER = "json"

# Brute-force protection of every password log-in (the site's, the browsable API's) and of token
# authentication (django-axes, its counters in the cache above): after AXES_FAILURE_LIMIT failures
# from one address, or for one user name, further attempts are refused with 429 for AXES_COOLOFF_TIME.
# Bad tokens count against their address only (controlplane.accounts.lockout).
AXES_HANDLER = "controlplane.accounts.lockout.LockoutHandler"
AXES_FAILURE_LIMIT = int(os.environ.get("RELAYGR_LOGIN_FAILURE_LIMIT", 10))
AXES_COOLOFF_TIME = timedelta(minutes=float(os.environ.get("RELAYGR_LOGIN_COOLOFF_MIN", 15)))
AXES_LOCKOUT_PARAMETERS = "controlplane.accounts.lockout.lockout_parameters"
AXES_LOCKOUT_CALLABLE = "controlplane.accounts.lockout.lockout_response"
AXES_RESET_ON_SUCCESS = False  # a known account must not reset an address's count of failures
AXES_DISABLE_ACCESS_LOG = True
AXES_VERBOSE = False
AXES_ENABLE_ADMIN = False
AXES_CLIENT_IP_CALLABLE = "controlplane.accounts.lockout.client_address"
# Reverse proxies in front of the web server: 0 trusts no X-Forwarded-For (the peer is the client).
RELAYGR_PROXY_COUNT = 0
AUTHENTICATION_BACKENDS = [
    "controlplane.accounts.lockout.LockoutBackend",  # first: refuses a locked-out address or user
    "django.contrib.auth.backends.ModelBackend",
]

REST_FRAMEWORK = {
    # Token first: its WWW-Authenticate header makes an anonymous request a 401, not a 403.
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "controlplane.accounts.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Deny by default: every view needs at least the viewer role, writes the operator role.
    "DEFAULT_PERMISSION_CLASSES": ["controlplane.accounts.permissions.RolePermission"],
    "DEFAULT_THROTTLE_CLASSES": ["controlplane.common.throttling.WriteRateThrottle"],
    "DEFAULT_PAGINATION_CLASS": "controlplane.common.pagination.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 100,
    "DEFAULT_RENDERER_CLASSES": [
        "rest_framework.renderers.JSONRenderer",
        "controlplane.common.renderers.BrowsableAPIWithoutFilterForms",
    ],
    "DEFAULT_PARSER_CLASSES": ["controlplane.common.parsers.BoundedJSONParser"],
    "DEFAULT_CONTENT_NEGOTIATION_CLASS": "controlplane.common.negotiation.FormatWinsNegotiation",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "controlplane.common.errors.exception_handler",
    "STRICT_JSON": True,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "RelayGR control plane API",
    "DESCRIPTION": (
        "Pools, immutable configuration revisions, publishing and rollback, fleet convergence and "
        "telemetry of the RelayGR worker fleet. Authenticate with a session or `Authorization: Token <key>`."
    ),
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["controlplane.accounts.permissions.RolePermission"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "controlplane.common.schema.document_rate_limits",
    ],
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "controlplane.common.context.RequestIdFilter"}},
    "formatters": {"request_id": {"format": "%(asctime)s %(levelname)s %(name)s [request %(request_id)s] %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "filters": ["request_id"], "formatter": "request_id"}},
    "root": {"handlers": ["console"], "level": "INFO"},
}
