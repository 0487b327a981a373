"""pytest-django: SQLite (in memory) unless DATABASE_URL names another database; fast hashing."""

from .base import *  # noqa: F403

DEBUG = False
SECRET_KEY = "test-only-not-secret-relaygr-control-plane-0123456789abcdefghijklmnop"
ALLOWED_HOSTS = ["testserver", "localhost", "127.0.0.1"]
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
LOGGING = {"version": 1, "disable_existing_loggers": False, "root": {"level": "WARNING"}}
# Whitenoise serves from the finders; no collectstatic output exists (or is needed) under test.
STATIC_ROOT = None
