"""Domain errors raised by services and selectors, and the one shape every API error takes.

Every error body is ``{"detail": "<what went wrong>", "errors": {"<field.path>": ["<message>", …]}}``
(``errors`` only when fields are at fault), so a client can point at the field it has to fix.
"""

from __future__ import annotations

import logging

from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    status_code = status.HTTP_400_BAD_REQUEST

    def __init__(self, detail: str, errors: dict[str, list[str]] | None = None):
        super().__init__(detail)
        self.detail = detail
        self.errors = errors or {}


class InvalidInput(ServiceError):
    status_code = status.HTTP_400_BAD_REQUEST


class NotFound(ServiceError):
    status_code = status.HTTP_404_NOT_FOUND


class Conflict(ServiceError):
    status_code = status.HTTP_409_CONFLICT


class TooManyRequests(ServiceError):
    """A limit on work in progress is reached; ``retry_after_s`` goes out as ``Retry-After``."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS

    def __init__(self, detail: str, retry_after_s: int, errors: dict[str, list[str]] | None = None):
        super().__init__(detail, errors)
        self.retry_after_s = retry_after_s


class Unavailable(ServiceError):
    """A dependency (Redis) cannot be reached; what the database holds is still right."""

    status_code = status.HTTP_503_SERVICE_UNAVAILABLE


def flatten_errors(detail, path: str = "") -> dict[str, list[str]]:
    """DRF's nested error detail → {"spec.trigger.at_risk_seq_len": [...], "parent_generation": [...]}."""
    out: dict[str, list[str]] = {}
    if isinstance(detail, dict):
        for key, value in detail.items():
            key = str(key)
            sub = path if key == "non_field_errors" and not path else (f"{path}.{key}" if path else key)
            for p, msgs in flatten_errors(value, sub).items():
                out.setdefault(p, []).extend(msgs)
    elif isinstance(detail, list) and detail and all(not isinstance(d, (dict, list)) for d in detail):
        out.setdefault(path or "(root)", []).extend(str(d) for d in detail)
    elif isinstance(detail, list):
        for i, value in enumerate(detail):
            for p, msgs in flatten_errors(value, f"{path}[{i}]").items():
                out.setdefault(p, []).extend(msgs)
    else:
        out.setdefault(path or "(root)", []).append(str(detail))
    return out


def _summary(errors: dict[str, list[str]]) -> str:
    return "; ".join(f"{path}: {' '.join(msgs)}" for path, msgs in errors.items())


def exception_handler(exc, context):
    if isinstance(exc, ServiceError):
        body = {"detail": exc.detail}
        if exc.errors:
            body["errors"] = exc.errors
        if isinstance(exc, Unavailable):
            logger.warning("service unavailable: %s", exc.detail)
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, TooManyRequests) else None
        return Response(body, status=exc.status_code, headers=headers)
    if isinstance(exc, (OperationalError, InterfaceError)):
        # Busy past the lock timeout, or unreachable: the request's transaction rolled back.
        logger.warning("database unavailable: %s", exc)
        return Response({"detail": f"The database could not complete the request ({type(exc).__name__}: {exc}); "
                                   "retry it."}, status=status.HTTP_503_SERVICE_UNAVAILABLE,
                        headers={"Retry-After": "1"})
    if isinstance(exc, RequestDataTooBig):
        return Response({"detail": "Request body is too large."}, status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE)
    if isinstance(exc, exceptions.ValidationError):
        errors = flatten_errors(exc.detail)
        return Response({"detail": f"Invalid input: {_summary(errors)}", "errors": errors},
                        status=status.HTTP_400_BAD_REQUEST)
    return drf_exception_handler(exc, context)
