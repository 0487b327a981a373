"""The schema as the next release would have it: ``trigger`` gains a field with a non-empty default,
declared the way the README's rule for adding a policy field says (``config.added_field``).

``install()`` patches it into this process's ``relay_engine.core.config`` (the tests' "upgraded control
plane"); ``python -m tests.schema_next --index N`` is an upgraded worker: the same
``workers.instance`` with the extended schema installed first.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from relay_engine.core import config

NEW_FIELD = "preinfer_gap_ms"
NEW_DEFAULT = 7.5
_RELEASED = config.TriggerPolicy


@dataclasses.dataclass(frozen=True)
class NextTriggerPolicy(config.TriggerPolicy):
    preinfer_gap_ms: float = config.added_field(NEW_DEFAULT)


def _next_trigger(data: Any, path: str, errs: config.FieldErrors, *, base=config._trigger) -> config.TriggerPolicy:
    """The released parser for the known fields, plus the new one as a new release would read it."""
    if not isinstance(data, dict):
        return base(data, path, errs)
    known = base({k: v for k, v in data.items() if k != NEW_FIELD}, path, errs)
    gap = config._float(data, NEW_FIELD, path, 0.0, 1000.0, NEW_DEFAULT, errs)
    released = {f.name: getattr(known, f.name) for f in dataclasses.fields(_RELEASED)}
    return NextTriggerPolicy(**released, preinfer_gap_ms=gap)


def install(monkeypatch=None) -> None:
    """Extend the schema in this process (through ``monkeypatch`` when given, so a test undoes it)."""
    setattr_ = monkeypatch.setattr if monkeypatch is not None else setattr
    setattr_(config, "TriggerPolicy", NextTriggerPolicy)
    setattr_(config, "_trigger", _next_trigger)


if __name__ == "__main__":
    install()
    from workers.instance import main

    sys.exit(main())
