"""The policy fields the config editor shows as a form: path (as validation errors name it), unit, help.

Ranges are not repeated here: the schema (``relay_engine.core.config``) judges every value and its
messages state what is allowed, so the form and the API can never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyField:
    path: str
    label: str
    unit: str
    kind: str  # "int", "float", "bool" or "text"
    help: str
    nullable: bool = False  # empty input means null (not "missing")


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
        PolicyField("cache.entry_ttl_ms", "HBM entry TTL", "ms", "int", "An HBM entry unused this long expires."),
        PolicyField("cache.dram_ttl_ms", "DRAM entry TTL", "ms", "int", "A DRAM entry unused this long expires."),
    )),
    FieldGroup("Disk tier", "A local-disk cache tier under DRAM: entries DRAM evicts are written to files (off the "
               "ranking path, checksummed) instead of dropped. Off by default.", (
        PolicyField("cache.disk.path", "Directory", "", "text",
                    "An absolute local directory; each instance keeps its files in a directory of its own below it "
                    "(created if missing). An instance that cannot write there refuses the revision."),
        PolicyField("cache.disk.budget_mb", "Disk budget", "MiB", "float",
                    "The bytes of the tier's files per instance; beyond it the oldest are deleted. Empty: the "
                    "schema's default."),
        PolicyField("cache.disk.ttl_ms", "Disk entry TTL", "ms", "int",
                    "A file unused this long expires. Empty: the schema's default."),
    ), section="cache.disk", toggle="Use a disk tier"),
    FieldGroup("SLO", "What the dashboards measure against the ranking P99 SLO.", (
        PolicyField("slo.target_ratio", "Target share within SLO", "ratio (0–1]", "float",
                    "Share of ranking requests that must finish within the SLO; 1 − target is the error budget."),
    )),
)
