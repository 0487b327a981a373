"""The one registration of the cache tiers under HBM: a new tier is its module, one entry in
``LOWER_TIERS`` and its tests.

An entry names the tier (which is also the ``Outcome`` of a prefix it served, and the word telemetry
counts its hits under), says how people read that outcome, names the core module that builds the tier
(its ``LOWER_TIER``, a ``tiers.LowerTier``) and, when operators configure the tier, declares its policy
section ``cache.<name>``: each field with its type, default, range and editor text. The schema
(``config``) parses and hashes every section from here and the config editor shows it as a form, so
neither names a tier. A section is off (None) by default and, off, absent from a spec's plain form (as
with ``config.added_field``), so a tier added later changes no stored revision's sha256.

Stdlib only (with the core's field checks): the control plane reads the registration without loading
torch, which is why the policy section is declared here rather than in the tier's own module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relay_engine.core import fields

# Hard limits of the schema; a device may impose tighter ones when a policy is applied.
MAX_BUDGET_MIB = 16 * 1024 * 1024  # 16 TiB: far above any host, still a finite number
MAX_TTL_MS = 7 * 24 * 3600 * 1000
MAX_PATH_CHARS = 4096


@dataclass(frozen=True)
class SectionField:
    """One field of a tier's policy section: how it is parsed and how the editor shows it."""

    name: str
    kind: str  # the editor's input: "int", "float", "bool" or "text"
    # The value of a raw input, or ``fields.FieldValueError`` saying what is allowed.
    parse: Callable[[Any], Any]
    label: str
    unit: str
    help: str
    default: Any = None  # None with ``required``: the field has no default
    required: bool = False
    # Added to the section after revisions with it were stored: left out of the plain form while it holds
    # its default, as with ``config.added_field``, so those revisions keep their sha256.
    added: bool = False


def number_field(name: str, default: float, lo: float, hi: float, *, label: str, unit: str,
                 help: str) -> SectionField:
    return SectionField(name, "float", lambda raw: fields.number(raw, lo, hi), label, unit, help, default)


def integer_field(name: str, default: int, lo: int, hi: int, *, label: str, unit: str,
                  help: str) -> SectionField:
    return SectionField(name, "int", lambda raw: fields.integer(raw, lo, hi), label, unit, help, default)


def absolute_directory(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.startswith("/") or "\x00" in raw or len(raw) > MAX_PATH_CHARS:
        raise fields.FieldValueError(f"must be an absolute directory path (at most {MAX_PATH_CHARS} characters), "
                                     f"got {fields.show(raw)}")
    return raw


def directory_field(name: str, *, label: str, help: str) -> SectionField:
    """A required absolute directory path (the field has no default)."""
    return SectionField(name, "text", absolute_directory, label, "", help, required=True)


@dataclass(frozen=True)
class PolicySection:
    """A tier's section of the policy, ``cache.<tier name>``: its fields (those without a default
    first) and the editor's text for it (a checkbox labelled ``toggle`` turns the section on)."""

    title: str
    note: str
    toggle: str
    fields: tuple[SectionField, ...]


@dataclass(frozen=True)
class LowerTierEntry:
    name: str  # the tier's outcome (``Outcome.<NAME>``) and its telemetry word
    label: str  # how people read the outcome: a prefix served from this tier
    module: str  # the core module whose ``LOWER_TIER`` builds the tier from a policy
    policy: PolicySection | None = None  # its section ``cache.<name>``, when operators configure it


# In lookup order, under HBM.
LOWER_TIERS: list[LowerTierEntry] = [
    LowerTierEntry("dram", "DRAM hit", "relay_engine.core.dram"),  # sized by cache.dram_budget_mb
    LowerTierEntry("disk", "disk hit", "relay_engine.core.disk", PolicySection(
        "Disk tier", "A local-disk cache tier under DRAM: entries DRAM evicts are written to files (off the "
        "ranking path, checksummed) instead of dropped. Off by default.", "Use a disk tier", (
            directory_field(
                "path", label="Directory",
                help="An absolute local directory; each instance keeps its files in a directory of its own below "
                     "it (created if missing). An instance that cannot write there refuses the revision."),
            number_field(
                "budget_mb", 16 * 1024.0, 0.0, MAX_BUDGET_MIB, label="Disk budget", unit="MiB",
                help="The bytes of the tier's files per instance; beyond it the oldest are deleted. Empty: the "
                     "schema's default."),
            integer_field(
                "ttl_ms", 3_600_000, 1, MAX_TTL_MS, label="Disk entry TTL", unit="ms",
                help="A file unused this long expires. Empty: the schema's default."),
        ))),
]
