"""The request id of the request being served, for audit entries written deep inside services."""

from __future__ import annotations

import contextvars

_request_id: contextvars.ContextVar[str] = contextvars.ContextVar("relaygr_request_id", default="")


def current_request_id() -> str:
    return _request_id.get()


def set_request_id(request_id: str) -> contextvars.Token:
    return _request_id.set(request_id)


def reset_request_id(token: contextvars.Token) -> None:
    _request_id.reset(token)


class RequestIdFilter:
    """Logging filter: every record carries the id of the request it was logged in (``-`` outside one),
    so the id a 500 names leads to its traceback in the log."""

    def filter(self, record) -> bool:
        record.request_id = current_request_id() or "-"
        return True
