"""Dry runs against a pool's live revision: a spec's errors and diff, an editing upload's section.

Nothing here writes. The editor calls these before it creates a revision through the API, where
the same schema (``relay_engine.core.config``) judges the spec again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relay_engine.core.config import validate_policy
from relay_engine.core.editing_io import FINGERPRINT_KEYS, UploadResult, parse_upload

from . import selectors
from .diff import spec_diff
from .models import Pool

__all__ = ["FINGERPRINT_KEYS", "SpecCheck", "editing_upload_check", "spec_check"]


@dataclass(frozen=True)
class SpecCheck:
    valid: bool
    errors: dict[str, list[str]]
    against: int  # the live generation the diff is taken against
    changes: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "errors": self.errors, "against": self.against, "changes": self.changes}


def spec_check(*, pool: Pool, spec: Any) -> SpecCheck:
    """The schema's errors by field path, and the changes against the live revision when valid."""
    live = selectors.revision_desired(pool=pool)
    parsed, errors = validate_policy(spec)
    changes = spec_diff(live.spec, parsed.to_dict()) if parsed is not None else []
    return SpecCheck(valid=not errors, errors=errors, against=live.generation, changes=changes)


def editing_upload_check(*, pool: Pool, name: str, data: bytes, rows: str = "",
                         fingerprint: dict[str, str] | None = None, scope: str = "",
                         provenance: str = "") -> UploadResult:
    """An uploaded ``.npy``/``.npz`` of directions → the validated ``editing`` section, or errors.

    The live revision's editing fingerprint fills what neither the form nor the file gives."""
    live = selectors.revision_desired(pool=pool)
    live_editing = (live.spec or {}).get("editing") or {}
    return parse_upload(name, data, rows=rows, fingerprint=fingerprint, scope=scope, provenance=provenance,
                        default_fingerprint=live_editing.get("fingerprint"))
