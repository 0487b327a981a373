"""OpenAPI post-processing: what every operation may answer besides its own responses."""

from __future__ import annotations

import copy

LOCKED_OUT = ("Too many requests: the caller's address or user is locked out after repeated failed "
              "log-ins or bad tokens, or the caller's rate of writes or uploads is over its limit. "
              "`Retry-After` says when to try again.")


def document_rate_limits(result, generator, request, public):
    """A 429 on every operation that can refuse an unauthenticated caller (any with a 401): lock-outs
    are checked before the view runs. Its body is the operation's error shape, as its 401 is."""
    for methods in result.get("paths", {}).values():
        for operation in methods.values():
            responses = operation.get("responses", {})
            if "401" in responses and "429" not in responses:
                responses["429"] = {"description": LOCKED_OUT, "content": copy.deepcopy(responses["401"].get("content", {}))}
    return result
