"""The policy schema: trigger thresholds, cache budgets, SLO and editing configuration.

Defined once here; the control plane's serializers and the workers' reconciler both call
``parse_policy`` so a value one side accepts the other cannot reject. Validation is strict and
collects every error by field path (``trigger.at_risk_seq_len``) instead of stopping at the first:
unknown keys, wrong types (``True`` is not an integer), NaN, infinities and out-of-range values are
all errors. Missing keys take the documented defaults, so a partial spec is fine; a typo is not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relay_engine.core import fields
from relay_engine.core.fields import FieldErrors, join
from relay_engine.core.lower_tiers import LOWER_TIERS, MAX_BUDGET_MIB, MAX_TTL_MS, PolicySection

SCHEMA_VERSION = 1

# Hard limits of the schema; a device may impose tighter ones when a policy is applied.
MAX_SEQ_LEN = 1 << 20
# Budgets are in MiB (2^20 bytes) wherever they are shown; the fields keep their stored names (``_mb``).
BYTES_PER_MIB = 1024 * 1024
MAX_ALPHA = 1000.0
MAX_EDITS = 4096
EDIT_SCOPES = ("all", "candidates")
MAX_LOWRANK_RANK = 64
MAX_LOWRANK_VALUES = 1 << 20  # numbers in all low-rank maps of a section together (R, W and b)
# Dataclass field metadata of a field added to the schema after revisions were stored: it is left out of
# the plain form while it holds its default (see ``added_field``).
OMIT_WHEN_DEFAULT = "omit_when_default"


def added_field(default: Any) -> Any:
    """Declare a field added to the schema after revisions were stored (every field beyond the baseline
    of ``SCHEMA_VERSION`` 1). While it holds ``default`` it is absent from the plain form — what the
    control plane stores and hashes, and what a worker hashes again — so a spec stored before the field
    existed parses, re-serialises and hashes exactly as before: no stored revision changes its sha256, no
    worker NACKs it, and a worker not yet upgraded still accepts a new revision that leaves the field
    alone. ``default`` must be immutable (a number, a string, None, a tuple)."""
    return field(default=default, metadata={OMIT_WHEN_DEFAULT: True})


class PolicyError(ValueError):
    """A spec that failed validation; ``errors`` maps each field path to its messages."""

    def __init__(self, errors: dict[str, list[str]]):
        self.errors = errors
        summary = "; ".join(f"{path}: {' '.join(msgs)}" for path, msgs in sorted(errors.items()))
        super().__init__(f"invalid policy: {summary}")


@dataclass(frozen=True)
class LatencyModel:
    """Full-inference latency of a prefix of n tokens: base_ms + per_token_ms·n + per_token_sq_ms·n²."""

    base_ms: float = 0.0
    per_token_ms: float = 0.0
    per_token_sq_ms: float = 0.0

    def predict_ms(self, seq_len: int) -> float:
        return self.base_ms + self.per_token_ms * seq_len + self.per_token_sq_ms * seq_len * seq_len

    def at_risk_seq_len(self, budget_ms: float) -> int:
        """Smallest n whose predicted full inference exceeds budget_ms (MAX_SEQ_LEN if none)."""
        lo, hi = 0, MAX_SEQ_LEN
        if self.predict_ms(hi) <= budget_ms:
            return MAX_SEQ_LEN
        while lo < hi:
            mid = (lo + hi) // 2
            if self.predict_ms(mid) > budget_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo


@dataclass(frozen=True)
class TriggerPolicy:
    # Pre-infer a request only when its long-term prefix has at least this many tokens. None means
    # "derive it from latency_model": the shortest prefix whose full inference breaks the SLO.
    at_risk_seq_len: int | None = 512
    latency_model: LatencyModel | None = None
    # Admit every pre-infer signal regardless of length (budgets still apply). For ablations.
    admit_all: bool = False
    max_preinfer_inflight: int = 4
    max_preinfer_tokens_per_s: float = 2_000_000.0
    ranking_p99_slo_ms: float = 50.0

    # Share of the instance's compute pre-inference gets while ranking also wants it (work-conserving:
    # alone, it takes all). CPU: the pre-inference thread's scheduling weight against ranking's;
    # CUDA: a low-priority stream. Ranking keeps the rest, so a backlog of prefills cannot starve it.
    preinfer_compute_share: float = 0.25

    def effective_at_risk_seq_len(self, ranking_wait_ms: float = 0.0) -> int:
        """The at-risk length in force: the fixed one, or — derived from the latency model — the
        shortest prefix whose full inference, after the ranking wait the instance sees now, breaks
        the SLO (so under load the threshold falls and more requests are pre-inferred)."""
        if self.at_risk_seq_len is not None:
            return self.at_risk_seq_len
        assert self.latency_model is not None  # guaranteed by validation
        return self.latency_model.at_risk_seq_len(max(0.0, self.ranking_p99_slo_ms - max(0.0, ranking_wait_ms)))

    def predicted_full_ms(self, seq_len: int) -> float | None:
        """Full inference of seq_len prefix tokens by the latency model, None without one."""
        return None if self.latency_model is None else self.latency_model.predict_ms(seq_len)


@dataclass(frozen=True)
class _CacheBudgets:
    hbm_budget_mb: float = 1024.0  # MiB
    dram_budget_mb: float = 4096.0  # MiB
    entry_ttl_ms: int = 120_000
    dram_ttl_ms: int = 600_000
    # False: no prefix is looked up or kept; every ranking request is a full forward (the relay
    # benchmark's baseline through the workers). Turning it off frees what the tiers hold.
    enabled: bool = added_field(True)

    @property
    def hbm_budget_bytes(self) -> int:
        return int(self.hbm_budget_mb * BYTES_PER_MIB)

    @property
    def dram_budget_bytes(self) -> int:
        return int(self.dram_budget_mb * BYTES_PER_MIB)


def _here(kind: type) -> type:
    """A class made at import time, as if defined in this module (where pickle looks for it)."""
    kind.__module__ = __name__
    globals()[kind.__name__] = kind
    return kind


def _section_type(name: str, section: PolicySection) -> type:
    """The frozen dataclass of a tier's policy section (``cache.disk`` → ``DiskTierPolicy``)."""
    return dataclasses.make_dataclass(
        f"{name.capitalize()}TierPolicy",
        [(f.name, Any) if f.required else (f.name, Any, added_field(f.default) if f.added else field(default=f.default))
         for f in section.fields],
        frozen=True)


# The policy section of each registered tier that has one, by tier name: ``cache.<name>``.
TIER_SECTIONS: dict[str, PolicySection] = {tier.name: tier.policy for tier in LOWER_TIERS if tier.policy is not None}
_SECTION_TYPES: dict[str, type] = {name: _here(_section_type(name, section)) for name, section in TIER_SECTIONS.items()}


def tier_policy_type(name: str) -> type:
    """The dataclass of the policy section of the tier ``name`` (its fields are the section's)."""
    return _SECTION_TYPES[name]


# The cache budgets, and one field per tier section: None (the default) is off. Each is an ``added_field``,
# left out of the plain form while off, so a spec without it keeps its hash.
CacheBudget = _here(dataclasses.make_dataclass(
    "CacheBudget", [(name, f"{kind.__name__} | None", added_field(None)) for name, kind in _SECTION_TYPES.items()],
    bases=(_CacheBudgets,), frozen=True))


@dataclass(frozen=True)
class SLO:
    # The latency objective itself is trigger.ranking_p99_slo_ms (one value, used by the trigger
    # and by the dashboards); this section holds what is measured against it.
    # Share of ranking requests that must finish within the SLO; 1 - target is the error budget.
    target_ratio: float = 0.99


@dataclass(frozen=True)
class ModelFingerprint:
    num_layers: int
    num_heads: int
    head_dim: int


@dataclass(frozen=True)
class HeadEdit:
    layer: int
    head: int
    direction: tuple[float, ...]
    alpha: float


@dataclass(frozen=True)
class LowRankEdit:
    """An input-dependent edit of some heads' outputs in one layer, in the LoReFT form
    ``h ← h + α·Rᵀ(W·h + b − R·h)``: h is the concatenation of those heads' outputs
    [len(heads)·head_dim]; R and W are [rank, len(heads)·head_dim], b is [rank]. With orthonormal rows
    in R (as the lab fits it) the edit replaces h's coordinates in R's subspace by ``W·h + b``."""

    layer: int
    heads: tuple[int, ...]
    rotation: tuple[tuple[float, ...], ...]  # R
    source_weight: tuple[tuple[float, ...], ...]  # W
    source_bias: tuple[float, ...]  # b
    alpha: float = 1.0

    @property
    def rank(self) -> int:
        return len(self.rotation)


@dataclass(frozen=True)
class EditingConfig:
    fingerprint: ModelFingerprint
    edits: tuple[HeadEdit, ...] = ()  # constant: α·direction added to one head's output
    # "all": every position is edited (the prefix KV changes too); "candidates": only the candidate
    # rows, so history KV is untouched. Cache keys carry the hash either way.
    scope: str = "candidates"
    provenance: dict[str, Any] = field(default_factory=dict)
    # input-dependent: low-rank maps of head outputs; every edit of a layer reads its unedited outputs
    lowrank: tuple[LowRankEdit, ...] = added_field(())

    @property
    def is_empty(self) -> bool:
        return not self.edits and not self.lowrank

    def content_hash(self) -> str:
        return sha256_of(to_plain(self))


MAX_DEDUP_TOLERANCE_S = 86_400.0


@dataclass(frozen=True)
class FeaturePolicy:
    """How histories are canonicalised before the model sees them, and so before their cache key is
    taken (``relay_engine.core.features``)."""

    # Collapse an event logged again (same item and action as the one before it) within this many
    # seconds of it; None (the default): off.
    dedup_events_within_s: float | None = None


@dataclass(frozen=True)
class PolicySpec:
    trigger: TriggerPolicy = TriggerPolicy()
    cache: CacheBudget = CacheBudget()
    slo: SLO = SLO()
    editing: EditingConfig | None = None
    schema_version: int = SCHEMA_VERSION
    # Left out of the plain form while at its default, so a spec without it keeps its hash.
    features: FeaturePolicy = added_field(FeaturePolicy())

    def to_dict(self) -> dict[str, Any]:
        return to_plain(self)

    def canonical_json(self) -> str:
        return canonical_json(self.to_dict())

    def sha256(self) -> str:
        return sha256_of(self.to_dict())

    def edit_hash(self) -> str:
        return self.editing.content_hash() if self.editing is not None and not self.editing.is_empty else "none"


def default_policy() -> PolicySpec:
    return PolicySpec()


@dataclass(frozen=True)
class SloTarget:
    p99_ms: float | None  # trigger.ranking_p99_slo_ms
    target_ratio: float | None  # slo.target_ratio


def slo_of(spec: dict[str, Any] | None) -> SloTarget:
    """The latency objective of a stored (plain JSON) spec and the share that must meet it; None where
    a section is absent. The one reader of these paths for dashboards, the API and the pages."""
    spec = spec if isinstance(spec, dict) else {}
    trigger, slo = spec.get("trigger"), spec.get("slo")
    return SloTarget(
        p99_ms=trigger.get("ranking_p99_slo_ms") if isinstance(trigger, dict) else None,
        target_ratio=slo.get("target_ratio") if isinstance(slo, dict) else None,
    )


# --- serialisation ---------------------------------------------------------------------------


def to_plain(value: Any) -> Any:
    """Dataclasses → dicts, tuples → lists, recursively (JSON-ready); a field declared with
    ``added_field`` is left out while it holds its default."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not (f.metadata.get(OMIT_WHEN_DEFAULT) and getattr(value, f.name) == f.default)}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_plain(v) for k, v in value.items()}
    return value


def canonical_json(data: Any) -> str:
    """The text a sha256 is taken of: keys sorted, no spaces, UTF-8, no NaN. Of a validated spec
    (``PolicySpec.to_dict``) it is canonical: the schema already gave every number one spelling per
    value (``fields``: ints where integers are asked for, floats with -0.0 as 0.0, whole floats in
    provenance as ints), so policies equal by value have one text and one sha256."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_of(data: Any) -> str:
    return hashlib.sha256(canonical_json(to_plain(data)).encode()).hexdigest()


# --- validation ------------------------------------------------------------------------------


def _checked(data: dict, key: str, path: str, check: Callable[[Any], Any], default: Any, errs: FieldErrors) -> Any:
    """``check(data[key])``, or ``default`` when the key is absent or the check fails (the error named by path)."""
    if key not in data:
        return default
    try:
        return check(data[key])
    except fields.FieldValueError as exc:
        errs.add(join(path, key), str(exc))
        return default


def _int(data: dict, key: str, path: str, lo: int, hi: int, default: Any, errs: FieldErrors,
         nullable: bool = False) -> Any:
    if nullable and data.get(key, default) is None:
        return None
    return _checked(data, key, path, lambda value: fields.integer(value, lo, hi), default, errs)


def _float(data: dict, key: str, path: str, lo: float, hi: float, default: Any, errs: FieldErrors,
           lo_open: bool = False) -> Any:
    return _checked(data, key, path, lambda value: fields.number(value, lo, hi, lo_open=lo_open), default, errs)


def _obj(data: Any, path: str, allowed: set[str], errs: FieldErrors) -> dict[str, Any] | None:
    if not isinstance(data, dict):
        errs.add(path, f"must be an object, got {type(data).__name__}")
        return None
    for key in sorted(set(data) - allowed, key=str):
        errs.add(join(path, str(key)), f"unknown field; allowed: {', '.join(sorted(allowed))}")
    return data


def _bool(data: dict, key: str, path: str, default: bool, errs: FieldErrors) -> bool:
    if key not in data:
        return default
    if not isinstance(data[key], bool):
        errs.add(join(path, key), f"must be true or false, got {data[key]!r}")
        return default
    return data[key]


def _latency_model(data: Any, path: str, errs: FieldErrors) -> LatencyModel | None:
    if data is None:
        return None
    obj = _obj(data, path, {"base_ms", "per_token_ms", "per_token_sq_ms"}, errs)
    if obj is None:
        return None
    return LatencyModel(
        base_ms=_float(obj, "base_ms", path, 0.0, 1e6, 0.0, errs),
        per_token_ms=_float(obj, "per_token_ms", path, 0.0, 1e3, 0.0, errs),
        per_token_sq_ms=_float(obj, "per_token_sq_ms", path, 0.0, 1e3, 0.0, errs),
    )


def _trigger(data: Any, path: str, errs: FieldErrors) -> TriggerPolicy:
    d = TriggerPolicy()
    allowed = {f.name for f in dataclasses.fields(TriggerPolicy)}
    obj = _obj(data, path, allowed, errs)
    if obj is None:
        return d
    at_risk = _int(obj, "at_risk_seq_len", path, 0, MAX_SEQ_LEN, d.at_risk_seq_len, errs, nullable=True)
    model = _latency_model(obj.get("latency_model"), join(path, "latency_model"), errs)
    if at_risk is None and model is None:
        errs.add(join(path, "at_risk_seq_len"), "is null, so trigger.latency_model must be given")
    return TriggerPolicy(
        at_risk_seq_len=at_risk,
        latency_model=model,
        admit_all=_bool(obj, "admit_all", path, d.admit_all, errs),
        max_preinfer_inflight=_int(obj, "max_preinfer_inflight", path, 0, 100_000, d.max_preinfer_inflight, errs),
        max_preinfer_tokens_per_s=_float(
            obj, "max_preinfer_tokens_per_s", path, 0.0, 1e10, d.max_preinfer_tokens_per_s, errs
        ),
        ranking_p99_slo_ms=_float(obj, "ranking_p99_slo_ms", path, 0.0, 60_000.0, d.ranking_p99_slo_ms, errs,
                                  lo_open=True),
        preinfer_compute_share=_float(obj, "preinfer_compute_share", path, 0.0, 1.0, d.preinfer_compute_share,
                                      errs, lo_open=True),
    )


def _cache(data: Any, path: str, errs: FieldErrors) -> CacheBudget:
    d = CacheBudget()
    obj = _obj(data, path, {f.name for f in dataclasses.fields(CacheBudget)}, errs)
    if obj is None:
        return d
    return CacheBudget(
        hbm_budget_mb=_float(obj, "hbm_budget_mb", path, 0.0, MAX_BUDGET_MIB, d.hbm_budget_mb, errs),
        dram_budget_mb=_float(obj, "dram_budget_mb", path, 0.0, MAX_BUDGET_MIB, d.dram_budget_mb, errs),
        entry_ttl_ms=_int(obj, "entry_ttl_ms", path, 1, MAX_TTL_MS, d.entry_ttl_ms, errs),
        dram_ttl_ms=_int(obj, "dram_ttl_ms", path, 1, MAX_TTL_MS, d.dram_ttl_ms, errs),
        enabled=_bool(obj, "enabled", path, d.enabled, errs),
        **{name: _tier_section(obj.get(name), join(path, name), name, errs) for name in TIER_SECTIONS},
    )


def _tier_section(data: Any, path: str, name: str, errs: FieldErrors) -> Any:
    """A tier's section by its declaration (``lower_tiers``): None when absent (the tier is off)."""
    if data is None:
        return None
    section = TIER_SECTIONS[name]
    obj = _obj(data, path, {f.name for f in section.fields}, errs)
    if obj is None:
        return None
    given = {f.name: None for f in section.fields if f.required} | obj  # a required field missing is checked as None
    return _SECTION_TYPES[name](**{f.name: _checked(given, f.name, path, f.parse, f.default, errs)
                                   for f in section.fields})


def _features(data: Any, path: str, errs: FieldErrors) -> FeaturePolicy:
    obj = _obj(data, path, {f.name for f in dataclasses.fields(FeaturePolicy)}, errs)
    if obj is None or obj.get("dedup_events_within_s") is None:
        return FeaturePolicy()
    return FeaturePolicy(_float(obj, "dedup_events_within_s", path, 0.0, MAX_DEDUP_TOLERANCE_S, None, errs))


def _slo(data: Any, path: str, errs: FieldErrors) -> SLO:
    d = SLO()
    obj = _obj(data, path, {f.name for f in dataclasses.fields(SLO)}, errs)
    if obj is None:
        return d
    return SLO(
        target_ratio=_float(obj, "target_ratio", path, 0.0, 1.0, d.target_ratio, errs, lo_open=True),
    )


MAX_PROVENANCE_INT = 2**63  # provenance integers beyond this are refused (they could not round-trip)


def _provenance(data: Any, path: str, errs: FieldErrors, depth: int = 0) -> Any:
    """Free-form JSON metadata (dataset hash, K, probe accuracies), bounded in depth and finite."""
    if depth > 6:
        errs.add(path, "is nested too deeply (at most 6 levels)")
        return None
    if isinstance(data, dict):
        if len(data) > 256:
            errs.add(path, "has more than 256 keys")
            return None
        return {str(k): _provenance(v, join(path, str(k)), errs, depth + 1) for k, v in data.items()}
    if isinstance(data, list):
        if len(data) > 4096:
            errs.add(path, "has more than 4096 items")
            return None
        return [_provenance(v, join(path, i), errs, depth + 1) for i, v in enumerate(data)]
    if isinstance(data, float):
        if not math.isfinite(data):
            errs.add(path, f"must be finite, got {data}")
            return None
        # One spelling per number, as in the typed fields: 1.0 is 1, -0.0 is 0.
        return int(data) if data.is_integer() and abs(data) <= MAX_PROVENANCE_INT else fields.canonical_float(data)
    if isinstance(data, int) and not isinstance(data, bool) and abs(data) > MAX_PROVENANCE_INT:
        errs.add(path, f"must be within ±2^63, got {fields.show(data)}")
        return None
    if isinstance(data, str) and len(data) > 10_000:
        errs.add(path, "is longer than 10000 characters")
        return None
    if data is None or isinstance(data, (str, int, float, bool)):
        return data
    errs.add(path, f"must be JSON data, got {type(data).__name__}")
    return None


def _editing(data: Any, path: str, errs: FieldErrors) -> EditingConfig | None:
    if data is None:
        return None
    obj = _obj(data, path, {"fingerprint", "edits", "scope", "provenance", "lowrank"}, errs)
    if obj is None:
        return None
    fp_path = join(path, "fingerprint")
    fp_obj = _obj(obj.get("fingerprint"), fp_path, {"num_layers", "num_heads", "head_dim"}, errs) \
        if "fingerprint" in obj else None
    if "fingerprint" not in obj:
        errs.add(fp_path, "is required: {num_layers, num_heads, head_dim} of the model the edits target")
    fingerprint = None
    if fp_obj is not None:
        values = {}
        for key in ("num_layers", "num_heads", "head_dim"):
            if key not in fp_obj:
                errs.add(join(fp_path, key), "is required")
            values[key] = _int(fp_obj, key, fp_path, 1, 65_536, None, errs)
        if all(v is not None for v in values.values()):
            fingerprint = ModelFingerprint(**values)

    scope = obj.get("scope", "candidates")
    if scope not in EDIT_SCOPES:
        errs.add(join(path, "scope"), f"must be one of {', '.join(EDIT_SCOPES)}, got {scope!r}")

    edits: list[HeadEdit] = []
    edits_path = join(path, "edits")
    raw_edits = obj.get("edits", [])
    if not isinstance(raw_edits, list):
        errs.add(edits_path, f"must be a list, got {type(raw_edits).__name__}")
        raw_edits = []
    if len(raw_edits) > MAX_EDITS:
        errs.add(edits_path, f"has {len(raw_edits)} edits; at most {MAX_EDITS}")
        raw_edits = []
    seen: dict[tuple[int, int], int] = {}
    for i, raw in enumerate(raw_edits):
        ep = join(edits_path, i)
        e = _obj(raw, ep, {"layer", "head", "direction", "alpha"}, errs)
        if e is None:
            continue
        for key in ("layer", "head", "direction", "alpha"):
            if key not in e:
                errs.add(join(ep, key), "is required")
        n_layers = fingerprint.num_layers if fingerprint else 65_536
        n_heads = fingerprint.num_heads if fingerprint else 65_536
        layer = _int(e, "layer", ep, 0, n_layers - 1, None, errs)
        head = _int(e, "head", ep, 0, n_heads - 1, None, errs)
        alpha = _float(e, "alpha", ep, -MAX_ALPHA, MAX_ALPHA, None, errs)
        direction = _direction(e.get("direction"), join(ep, "direction"), fingerprint, errs) \
            if "direction" in e else None
        if layer is not None and head is not None:
            if (layer, head) in seen:
                errs.add(ep, f"duplicates edits[{seen[(layer, head)]}] (layer {layer}, head {head})")
            seen.setdefault((layer, head), i)
        if None not in (layer, head, alpha, direction):
            edits.append(HeadEdit(layer=layer, head=head, direction=direction, alpha=alpha))

    lowrank = _lowrank(obj.get("lowrank", []), join(path, "lowrank"), fingerprint, errs)
    provenance = _provenance(obj.get("provenance", {}), join(path, "provenance"), errs)
    if not isinstance(provenance, dict):
        errs.add(join(path, "provenance"), "must be an object")
        provenance = {}
    if fingerprint is None:
        return None
    return EditingConfig(fingerprint=fingerprint, edits=tuple(edits), scope=scope, provenance=provenance,
                         lowrank=tuple(lowrank))


_LOWRANK_KEYS = ("layer", "heads", "rotation", "source_weight", "source_bias", "alpha")


def _lowrank(raw_maps: Any, path: str, fingerprint: ModelFingerprint | None, errs: FieldErrors) -> list[LowRankEdit]:
    """The low-rank maps: indices in range, a head in at most one map per layer, R/W/b of matching
    shapes (rank 1…min(MAX_LOWRANK_RANK, width)), all finite, at most MAX_LOWRANK_VALUES numbers."""
    if not isinstance(raw_maps, list):
        errs.add(path, f"must be a list, got {type(raw_maps).__name__}")
        return []
    if len(raw_maps) > MAX_EDITS:
        errs.add(path, f"has {len(raw_maps)} maps; at most {MAX_EDITS}")
        return []
    # counted from list lengths alone, before any number is read
    n_values = sum(_listed_values(m.get(key)) for m in raw_maps if isinstance(m, dict)
                   for key in ("rotation", "source_weight", "source_bias"))
    if n_values > MAX_LOWRANK_VALUES:
        errs.add(path, f"holds {n_values} numbers; at most {MAX_LOWRANK_VALUES} in all maps together")
        return []
    n_layers = fingerprint.num_layers if fingerprint else 65_536
    n_heads = fingerprint.num_heads if fingerprint else 65_536
    owner: dict[tuple[int, int], int] = {}
    maps: list[LowRankEdit] = []
    for i, raw in enumerate(raw_maps):
        mp = join(path, i)
        m = _obj(raw, mp, set(_LOWRANK_KEYS), errs)
        if m is None:
            continue
        for key in _LOWRANK_KEYS[:-1]:
            if key not in m:
                errs.add(join(mp, key), "is required")
        layer = _int(m, "layer", mp, 0, n_layers - 1, None, errs)
        heads = _heads(m.get("heads"), join(mp, "heads"), n_heads, errs) if "heads" in m else None
        alpha = _float(m, "alpha", mp, -MAX_ALPHA, MAX_ALPHA, 1.0, errs)
        width = len(heads) * fingerprint.head_dim if heads is not None and fingerprint is not None else None
        rotation = _matrix(m.get("rotation"), join(mp, "rotation"), None, width, errs) if "rotation" in m else None
        rank = None if rotation is None else len(rotation)
        if rank is not None and width is not None and rank > min(MAX_LOWRANK_RANK, width):
            errs.add(join(mp, "rotation"), f"has rank {rank}; at most {min(MAX_LOWRANK_RANK, width)} "
                                           f"(the lesser of {MAX_LOWRANK_RANK} and len(heads)·head_dim = {width})")
            rotation = None
        source_weight = _matrix(m.get("source_weight"), join(mp, "source_weight"), rank, width, errs) \
            if "source_weight" in m else None
        source_bias = _vector(m.get("source_bias"), join(mp, "source_bias"), rank, errs) \
            if "source_bias" in m else None
        if layer is not None and heads is not None:
            for h in heads:
                if (layer, h) in owner:
                    errs.add(join(mp, "heads"), f"head {h} of layer {layer} is already edited by "
                                                f"{join(path, owner[(layer, h)])}; a head takes one map")
                owner.setdefault((layer, h), i)
        if None not in (layer, heads, rotation, source_weight, source_bias, alpha):
            maps.append(LowRankEdit(layer=layer, heads=heads, rotation=rotation, source_weight=source_weight,
                                    source_bias=source_bias, alpha=alpha))
    return maps


def _listed_values(raw: Any) -> int:
    """How many entries a list (or a list of lists) holds, counted without reading them."""
    if not isinstance(raw, list):
        return 0
    return sum(len(row) if isinstance(row, list) else 1 for row in raw)


def _heads(raw: Any, path: str, n_heads: int, errs: FieldErrors) -> tuple[int, ...] | None:
    try:
        heads = fields.int_list(raw, min(n_heads, MAX_EDITS), 0, n_heads - 1)
    except fields.FieldValueError as exc:
        errs.add(path, str(exc))
        return None
    if not heads:
        errs.add(path, "is empty; list the heads (of this layer) whose outputs the map edits")
        return None
    if len(set(heads)) != len(heads):
        errs.add(path, f"lists a head twice: {heads}")
        return None
    return tuple(heads)


def _vector(raw: Any, path: str, length: int | None, errs: FieldErrors) -> tuple[float, ...] | None:
    try:
        return tuple(fields.finite_list(raw, length))
    except fields.FieldValueError as exc:
        errs.add(path, str(exc).replace("expected", "the rotation's rank is"))
        return None


def _matrix(raw: Any, path: str, n_rows: int | None, width: int | None,
            errs: FieldErrors) -> tuple[tuple[float, ...], ...] | None:
    """A non-empty list of rows, each ``width`` finite numbers (``n_rows`` rows when given)."""
    if not isinstance(raw, list) or not raw:
        errs.add(path, f"must be a non-empty list of rows (lists of numbers), got {fields.show(raw)}")
        return None
    if n_rows is not None and len(raw) != n_rows:
        errs.add(path, f"has {len(raw)} rows; the rotation's rank is {n_rows}")
        return None
    rows = []
    for r, row in enumerate(raw):
        try:
            rows.append(tuple(fields.finite_list(row, width)))
        except fields.FieldValueError as exc:
            errs.add(join(path, r), str(exc).replace("expected", "len(heads)·head_dim is"))
            return None
    return tuple(rows)


def _direction(raw: Any, path: str, fingerprint: ModelFingerprint | None, errs: FieldErrors) -> tuple | None:
    try:
        values = fields.finite_list(raw, fingerprint.head_dim if fingerprint is not None else None)
    except fields.FieldValueError as exc:
        errs.add(path, str(exc).replace("expected", "the model's head_dim is"))
        return None
    return tuple(values)


_TOP_LEVEL = {"trigger", "cache", "slo", "editing", "schema_version", "features"}


def validate_policy(data: Any) -> tuple[PolicySpec | None, dict[str, list[str]]]:
    """Return (spec, {}) for a valid spec, or (None, errors by field path)."""
    errs = FieldErrors()
    obj = _obj(data, "", _TOP_LEVEL, errs)
    if obj is None:
        return None, errs.by_path
    version = obj.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION or isinstance(version, bool):
        errs.add("schema_version", f"must be {SCHEMA_VERSION}, got {version!r}")
    spec = PolicySpec(
        trigger=_trigger(obj.get("trigger", {}), "trigger", errs),
        cache=_cache(obj.get("cache", {}), "cache", errs),
        slo=_slo(obj.get("slo", {}), "slo", errs),
        editing=_editing(obj.get("editing"), "editing", errs),
        features=_features(obj.get("features", {}), "features", errs),
    )
    if not spec.cache.enabled and spec.trigger.max_preinfer_inflight > 0:
        # A pre-inference with nowhere to keep its KV would be work thrown away: say so, never do it.
        errs.add("cache.enabled", "is false (no cache), so trigger.max_preinfer_inflight must be 0 "
                                  f"(no pre-inference), got {spec.trigger.max_preinfer_inflight}")
    if errs.by_path:
        return None, errs.by_path
    return spec, {}


def parse_policy(data: Any) -> PolicySpec:
    """Validated spec, or PolicyError carrying every error by field path."""
    spec, errors = validate_policy(data)
    if errors:
        raise PolicyError(errors)
    assert spec is not None
    return spec


class DigestMismatch(ValueError):
    """A revision whose spec does not hash to the sha256 it carries (corrupted, or tampered with)."""


def revision_policy(spec: Any, sha256: str) -> PolicySpec:
    """The policy of a revision (a stored spec and the sha256 stored with it), validated and its digest
    checked: what a worker applies. The control plane stores ``PolicySpec.to_dict()`` and hashes it with
    ``PolicySpec.sha256()``; the same function hashes it here, and by the rule of ``added_field`` a schema
    that gained fields since hashes it alike. A spec stored before that rule may lack a field then added
    without it; its hash as stored is accepted too. A spec altered anywhere matches neither."""
    policy = parse_policy(spec)
    if sha256 not in (policy.sha256(), sha256_of(spec)):
        raise DigestMismatch(f"sha256: the revision says {sha256}, its spec hashes to {sha256_of(spec)} "
                             f"as stored and to {policy.sha256()} as parsed")
    return policy
