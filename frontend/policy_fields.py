"""The policy fields the config editor shows as a form: path (as validation errors name it), unit, help.

A cache tier's section (``cache.disk``) comes from the tier's registration, so a new tier adds nothing
here. Ranges are not repeated here: the schema (``relay_engine.core.config``) judges every value and its
messages state what is allowed, so the form and the API can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from controlplane.policies.checks import TIER_SECTIONS, schema_default


@dataclass(frozen=True)
class PolicyField:
    path: str
    label: str
    unit: str
    kind: str  # "int", "float", "bool" or "text"
    help: str
    nullable: bool = False  # empty input means null (not "missing")

    @property
    def default(self) -> Any:
        """The schema's default: what the form shows where the live spec leaves the field out (a field
        added with ``config.added_field`` is absent from a spec that holds its default)."""
        return schema_default(self.path)


@dataclass(frozen=True)
class FieldGroup:
    title: str
    note: str
    fields: tuple[PolicyField, ...]
    # An optional section the fields live in (``cache.disk``): a checkbox (labelled ``toggle``) turns it on;
    # off, the section is left out of the spec (a field added with ``config.added_field`` keeps its hash), and
    # a field left empty takes the schema's default.
    section: str = ""
    toggle: str = ""


def _tier_group(name: str, section) -> FieldGroup:
    """The form of a cache tier's policy section, from its declaration (``relay_engine.core.lower_tiers``)."""
    path = f"cache.{name}"
    return FieldGroup(section.title, section.note, tuple(
        PolicyField(f"{path}.{f.name}", f.label, f.unit, f.kind, f.help) for f in section.fields),
        section=path, toggle=section.toggle)


FIELD_GROUPS: tuple[FieldGroup, ...] = (
    FieldGroup("Trigger thresholds", "Which requests are pre-inferred, and how much pre-inference load is allowed.", (
        PolicyField("trigger.at_risk_seq_len", "At-risk prefix length", "tokens", "int",
                    "Pre-infer a request only when its long-term prefix has at least this many tokens. "
                    "Leave empty to derive it from the latency model below.", nullable=True),
        PolicyField("trigger.max_preinfer_inflight", "Max pre-inferences in flight", "requests", "int",
                    "Per instance; further signals are refused, counted by reason on the live page."),
        PolicyField("trigger.max_preinfer_tokens_per_s", "Max pre-infer token rate", "tokens/s", "float",
                    "Per instance; further signals are refused, counted by reason on the live page."),
        PolicyField("trigger.ranking_p99_slo_ms", "Ranking P99 SLO", "ms", "float",
                    "The ranking latency objective; the dashboards draw it as the SLO line."),
        PolicyField("trigger.preinfer_compute_share", "Pre-inference compute share", "ratio (0–1]", "float",
                    "Share of an instance's compute pre-inference gets while ranking also runs (alone it "
                    "takes all); ranking keeps the rest."),
        PolicyField("trigger.admit_all", "Admit every signal", "", "bool",
                    "Ignore the at-risk length (budgets still apply). For ablations only."),
    )),
    FieldGroup("Latency model", "Full-inference latency of n prefix tokens: base + per_token·n + per_token_sq·n². "
               "Used only when the at-risk length is empty; leave all three empty for none.", (
        PolicyField("trigger.latency_model.base_ms", "Base latency", "ms", "float", "Fixed cost of one inference."),
        PolicyField("trigger.latency_model.per_token_ms", "Per-token latency", "ms/token", "float",
                    "Linear cost per prefix token."),
        PolicyField("trigger.latency_model.per_token_sq_ms", "Quadratic latency", "ms/token²", "float",
                    "Attention's quadratic cost per token²."),
    )),
    FieldGroup("Cache budgets", "Bytes held by prefix KV caches per instance, and how long entries live.", (
        PolicyField("cache.hbm_budget_mb", "HBM budget", "MiB", "float",
                    "Accelerator memory for resident caches; beyond it entries are demoted to DRAM."),
        PolicyField("cache.dram_budget_mb", "DRAM budget", "MiB", "float",
                    "Host memory for demoted caches; beyond it entries are dropped."),
        PolicyField("cache.entry_ttl_ms", "HBM entry TTL", "ms", "int",
                    "An entry expires this long after it entered HBM (computed or promoted), however often it is read."),
        PolicyField("cache.dram_ttl_ms", "DRAM entry TTL", "ms", "int", "A DRAM entry unused this long expires."),
        PolicyField("cache.enabled", "Cache prefixes", "", "bool",
                    "Off: no prefix is looked up or kept and every ranking request runs a full forward (a baseline "
                    "to compare against); what the tiers hold is freed. Needs pre-inference off "
                    "(trigger.max_preinfer_inflight 0)."),
    )),
    *(_tier_group(name, section) for name, section in TIER_SECTIONS.items()),
    FieldGroup("SLO", "What the dashboards measure against the ranking P99 SLO.", (
        PolicyField("slo.target_ratio", "Target share within SLO", "ratio (0–1]", "float",
                    "Share of ranking requests that must finish within the SLO; 1 − target is the error budget."),
    )),
)
