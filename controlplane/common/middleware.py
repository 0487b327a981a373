"""Request ids (echoed and recorded in audit entries) and the request-body size limit (413)."""

from __future__ import annotations

import re
import uuid

from django.conf import settings
from django.http import JsonResponse

from .context import reset_request_id, set_request_id

REQUEST_ID_HEADER = "X-Request-ID"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")


class RequestIdMiddleware:
    """Takes a well-formed X-Request-ID from the caller (a proxy's, say) or makes one up."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        given = request.headers.get(REQUEST_ID_HEADER, "")
        request_id = given if _VALID_REQUEST_ID.match(given) else uuid.uuid4().hex
        request.request_id = request_id
        token = set_request_id(request_id)
        try:
            response = self.get_response(request)
        finally:
            reset_request_id(token)
        response[REQUEST_ID_HEADER] = request_id
        return response


class BodySizeLimitMiddleware:
    """Refuses a body larger than RELAYGR_MAX_BODY_BYTES by its Content-Length, before any parsing."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        limit = settings.RELAYGR_MAX_BODY_BYTES
        raw_length = request.META.get("CONTENT_LENGTH") or "0"
        try:
            length = int(raw_length)
        except ValueError:
            return JsonResponse({"detail": f"Content-Length must be an integer, got {raw_length[:32]!r}."},
                                status=400)
        if length > limit:
            return JsonResponse(
                {"detail": f"Request body is {length} bytes; at most {limit} bytes are accepted."}, status=413
            )
        return self.get_response(request)
