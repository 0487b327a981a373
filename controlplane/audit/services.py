"""The one write of the audit log: an entry, stamped with the request it came from."""

from __future__ import annotations

from typing import Any

from controlplane.common.context import current_request_id

from .models import AuditEntry


def audit_record(
    *, actor: str, action: str, object_type: str, object_id: str, pool: str = "",
    before: Any = None, after: Any = None,
) -> AuditEntry:
    return AuditEntry.objects.create(
        actor=actor, request_id=current_request_id(), action=action, object_type=object_type,
        object_id=object_id, pool=pool, before=before, after=after,
    )
