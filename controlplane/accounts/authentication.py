"""``Authorization: Token <key>`` (``Bearer`` is accepted too, for Prometheus scrapers)."""

from __future__ import annotations

from rest_framework import authentication, exceptions

from . import lockout
from .models import ApiToken, token_digest

KEYWORDS = ("token", "bearer")


class TokenAuthentication(authentication.BaseAuthentication):
    keyword = "Token"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).split()
        if not header or header[0].lower().decode(errors="replace") not in KEYWORDS:
            return None
        if len(header) != 2:
            raise exceptions.AuthenticationFailed("Authorization header must be 'Token <key>'.")
        # An address that keeps presenting bad tokens is refused before any lookup (lockout.py).
        if not lockout.token_check_allowed(request._request):
            raise exceptions.Throttled(wait=lockout.retry_after_s(), detail=lockout.lockout_message())
        try:
            key = header[1].decode("ascii")
        except UnicodeDecodeError:
            key = None
        token = None if key is None else (
            ApiToken.objects.select_related("user")
            .filter(key_digest=token_digest(key), revoked_at__isnull=True)
            .first()
        )
        if token is None or not token.user.is_active:
            lockout.token_failed(request._request)
            raise exceptions.AuthenticationFailed(
                "Token key must be ASCII." if key is None else "Invalid or revoked token.")
        return token.user, token

    def authenticate_header(self, request) -> str:
        return self.keyword


class PageSessionAuthentication(authentication.SessionAuthentication):
    """The pages' own JSON endpoints: the browser's session (with its CSRF check) and nothing else,
    since a token is for the API. An anonymous call is a 401, as on the API (DRF answers a session
    without a challenge with a 403)."""

    def authenticate_header(self, request) -> str:
        return "Session"
