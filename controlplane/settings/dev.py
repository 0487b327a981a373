"""Local development: debug on, a fixed throwaway secret, any local host."""

from .base import *  # noqa: F403

DEBUG = True
SECRET_KEY = "dev-only-not-secret-relaygr-control-plane-0123456789abcdefghijklmnop"
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]
