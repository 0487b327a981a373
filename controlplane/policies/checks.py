"""Dry runs against a pool's live revision: a spec's errors and diff, an editing upload's section.

Nothing here writes. The editor calls these before it creates a revision through the API, where
the same schema (``relay_engine.core.config``) judges the spec again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from controlplane.common.errors import Unavailable
from controlplane.fleet import selectors as fleet_selectors
from relay_engine.core.config import (
    TIER_SECTIONS,
    ModelFingerprint,
    default_policy,
    to_plain,
    validate_policy,
)
from relay_engine.core.editing_io import FINGERPRINT_KEYS, UploadResult, parse_upload

from . import selectors
from .diff import spec_diff
from .models import Pool

# The policy sections of the cache tiers (``cache.<tier>``), which the editor shows as forms of their own.
__all__ = ["FINGERPRINT_KEYS", "TIER_SECTIONS", "SpecCheck", "editing_upload_check", "spec_check"]


@dataclass(frozen=True)
class SpecCheck:
    valid: bool
    errors: dict[str, list[str]]
    against: int  # the live generation the diff is taken against
    changes: list[dict[str, Any]]
    sha256: str | None  # of the normalised spec, when valid: the revision it would be

    def to_dict(self) -> dict[str, Any]:
        return {"valid": self.valid, "errors": self.errors, "against": self.against, "changes": self.changes,
                "sha256": self.sha256}


def schema_default(path: str) -> Any:
    """The schema's default at a field path (``cache.enabled``), as plain data; None inside a section that
    is off by default. A field added with ``config.added_field`` is absent from a spec holding its default,
    so the editor shows this where the live spec leaves the field out."""
    value: Any = default_policy()
    for key in path.split("."):
        value = getattr(value, key, None)
    return to_plain(value)


def spec_check(*, pool: Pool, spec: Any) -> SpecCheck:
    """The schema's errors by field path, an edit for another model than the pool's instances serve
    (they would NACK it), and the changes against the live revision."""
    live = selectors.revision_desired(pool=pool)
    parsed, errors = validate_policy(spec)
    if parsed is not None and parsed.editing is not None:
        errors = _model_errors(pool, parsed.editing.fingerprint)
    changes = spec_diff(live.spec, parsed.to_dict()) if parsed is not None else []
    return SpecCheck(valid=not errors, errors=errors, against=live.generation, changes=changes,
                     sha256=parsed.sha256() if parsed is not None and not errors else None)


def _described(fingerprint: ModelFingerprint) -> str:
    return f"{fingerprint.num_layers} layers × {fingerprint.num_heads} heads × head_dim {fingerprint.head_dim}"


def _served_models(pool: Pool) -> dict[ModelFingerprint, list[str]]:
    """The models the pool's live instances serve; none known when Redis cannot say (the instances then
    judge an edit when it is published, as they always do)."""
    try:
        return fleet_selectors.pool_models(pool=pool)
    except Unavailable:
        return {}


def _model_errors(pool: Pool, fingerprint: ModelFingerprint) -> dict[str, list[str]]:
    models = _served_models(pool)
    if not models or set(models) == {fingerprint}:
        return {}
    served = "; ".join(f"{_described(model)} ({', '.join(names)})" for model, names in models.items())
    return {"editing.fingerprint": [
        f"targets {_described(fingerprint)}, but this pool's live instances serve {served}: they would refuse "
        "it (NACK). Fit the edit on the pool's model."]}


def editing_upload_check(*, pool: Pool, name: str, data: bytes, rows: str = "",
                         fingerprint: dict[str, str] | None = None, scope: str = "",
                         provenance: str = "") -> UploadResult:
    """An uploaded ``.npy``/``.npz`` of directions → the validated ``editing`` section, or errors.

    What neither the form nor the file gives of the fingerprint comes from the model the pool's
    instances serve (when they agree on one), else from the live revision's editing section."""
    models = list(_served_models(pool))
    live_editing = (selectors.revision_desired(pool=pool).spec or {}).get("editing") or {}
    default = asdict(models[0]) if len(models) == 1 else live_editing.get("fingerprint")
    return parse_upload(name, data, rows=rows, fingerprint=fingerprint, scope=scope, provenance=provenance,
                        default_fingerprint=default)
