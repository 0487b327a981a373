from __future__ import annotations

from controlplane.common.errors import NotFound
from controlplane.policies.models import Pool

from .models import Preview


def preview_get(*, pool: Pool, preview_id: int) -> Preview:
    preview = Preview.objects.filter(pool=pool, pk=preview_id).first()
    if preview is None:
        raise NotFound(f"Pool {pool.name!r} has no preview {preview_id}.")
    return preview
