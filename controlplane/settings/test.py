"""pytest-django: SQLite unless DATABASE_URL names another database; fast hashing; a private cache."""

import os
import tempfile

from .base import *  # noqa: F403

DEBUG = False
SECRET_KEY = "test-only-not-secret-relaygr-control-plane-0123456789abcdefghijklmnop"
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}
# Whitenoise serves from the finders; no collectstatic output exists (or is needed) under test.
STATIC_ROOT = None

# The test database of SQLite is a file, not shared memory, so that tests with threads meet the real
# thing: WAL, IMMEDIATE transactions and the busy timeout of base (shared memory locks tables instead).
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    DATABASES["default"]["TEST"] = {  # noqa: F405
        "NAME": os.path.join(tempfile.gettempdir(), f"relaygr-test-{os.getpid()}.sqlite3")}

# Each test process has its own cache; tests of the Redis cache point it at the test Redis under
# their own key prefix (tests/controlplane/fixtures.py: redis_cache), so tests never share counters.
CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}
