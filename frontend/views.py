"""Pages: each checks the session and the role, renders a template, and leaves live data to its script,
which calls the REST API with the session cookie. The audit log renders on the server (it is a
filtered table, not a live view); the editor's dry-run check and its NumPy upload of editing
directions are the JSON endpoints of its own (both write nothing), DRF views like the API's."""

from __future__ import annotations

import json

from csp.decorators import csp_update
from django.contrib.auth.mixins import LoginRequiredMixin
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import render
from django.views.generic import TemplateView
from drf_spectacular.utils import extend_schema
from rest_framework.exceptions import Throttled, ValidationError
from rest_framework.parsers import MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.accounts.authentication import PageSessionAuthentication
from controlplane.accounts.roles import Role, role_of
from controlplane.audit import selectors as audit_selectors
from controlplane.audit.api.serializers import AuditQuerySerializer
from controlplane.audit.models import AuditEntry
from controlplane.common.errors import NotFound
from controlplane.common.throttling import UploadRateThrottle
from controlplane.common.views import is_instance_of, validated
from controlplane.policies import checks
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from controlplane.telemetry.selectors import (
    TOP_DEFAULT,
    TOP_MAX,
    WINDOWS,
    cache_tiers,
    lookup_outcomes,
    miss_reasons,
    refusal_reasons,
)

from .assets import PLOTLY_VERSION, plotly_style_sources
from .policy_fields import FIELD_GROUPS
from .serializers import EditingUploadInputSerializer, SpecCheckInputSerializer

DEFAULT_WINDOW = "1h"
AUDIT_PAGE_SIZE = 50


class PageView(LoginRequiredMixin, TemplateView):
    """A page for any user holding a role; ``self.role`` is that role."""

    tab = ""

    def dispatch(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        if not request.user.is_authenticated:
            return self.handle_no_permission()
        self.role = role_of(request.user)
        if self.role is None:
            return render(request, "frontend/no_role.html", status=403)
        return super().dispatch(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(
            pool_names=list(Pool.objects.order_by("name").values_list("name", flat=True)),
            role_label=self.role.label, can_edit=self.role >= Role.OPERATOR, is_admin=self.role >= Role.ADMIN,
            tab=self.tab, plotly_version=PLOTLY_VERSION, refusal_reasons=json.dumps(refusal_reasons()),
            outcomes=json.dumps(lookup_outcomes()), cache_tiers=json.dumps(cache_tiers()),
            miss_reasons=json.dumps(miss_reasons()),
        )
        return context


class PoolPageView(PageView):
    """A page about one pool; an unknown pool is a 404 page that lists the pools there are."""

    def get(self, request, *args, **kwargs):
        try:
            self.pool = policy_selectors.pool_get(name=kwargs["pool"])
        except NotFound:
            context = super().get_context_data(missing_pool=kwargs["pool"])
            return render(request, "frontend/pool_missing.html", context, status=404)
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        slo = self.pool.slo
        context.update(pool=self.pool, slo_ms=slo.p99_ms, slo_target_ratio=slo.target_ratio)
        return context


class TimeWindowMixin:
    """Pages with the time-range picker: the windows offered and the one asked for (?window=)."""

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        window = self.request.GET.get("window", DEFAULT_WINDOW)
        context.update(windows=list(WINDOWS), window=window if window in WINDOWS else DEFAULT_WINDOW)
        return context


class ChartsMixin:
    """Pages that draw plotly.js charts: the stylesheets plotly.js writes itself are allowed, by hash, on
    top of the site's Content-Security-Policy (no inline style otherwise)."""

    def dispatch(self, request: HttpRequest, *args, **kwargs) -> HttpResponse:
        view = csp_update({"style-src": plotly_style_sources()})(super().dispatch)
        return view(request, *args, **kwargs)


class OverviewView(ChartsMixin, TimeWindowMixin, PageView):
    template_name = "frontend/overview.html"
    tab = "overview"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(pools=policy_selectors.pool_list())
        return context


class LiveView(ChartsMixin, TimeWindowMixin, PoolPageView):
    template_name = "frontend/live.html"
    tab = "live"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(top_default=TOP_DEFAULT, top_max=TOP_MAX)
        return context


class InstanceView(ChartsMixin, TimeWindowMixin, PoolPageView):
    """One instance's own page (the drill-down from the live view): its figures and its status."""

    template_name = "frontend/instance.html"
    tab = "live"

    def get(self, request, *args, **kwargs):
        if not is_instance_of(kwargs["pool"], kwargs["instance"]):
            raise Http404(f"{kwargs['instance']} is not an instance of pool {kwargs['pool']}")
        return super().get(request, *args, **kwargs)

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        context.update(instance=self.kwargs["instance"])
        return context


class ConfigView(ChartsMixin, PoolPageView):  # the cache curves beside the budgets
    template_name = "frontend/config.html"
    tab = "config"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        live = policy_selectors.revision_desired(pool=self.pool)
        context.update(
            field_groups=FIELD_GROUPS,
            editor_state={
                "pool": self.pool.name,
                "can_edit": context["can_edit"],
                "live": {"generation": live.generation, "spec": live.spec, "sha256": live.sha256,
                         "author": live.author, "comment": live.comment, "created_at": live.created_at.isoformat()},
                "latest_generation": self.pool.latest_generation,
                "fields": [{"path": f.path, "kind": f.kind, "nullable": f.nullable, "section": group.section,
                            "default": f.default}
                           for group in FIELD_GROUPS for f in group.fields],
            },
        )
        return context


class FleetView(PoolPageView):
    template_name = "frontend/fleet.html"
    tab = "fleet"


class AuditView(PageView):
    template_name = "frontend/audit.html"
    tab = "audit"

    def get_context_data(self, **kwargs):
        context = super().get_context_data(**kwargs)
        raw = {key: value for key, value in self.request.GET.items() if key in AuditQuerySerializer().fields and value}
        query = AuditQuerySerializer(data=raw)
        entries = audit_selectors.audit_list(**query.validated_data) if query.is_valid() else AuditEntry.objects.none()
        page = Paginator(entries, AUDIT_PAGE_SIZE).get_page(self.request.GET.get("page"))
        filters = self.request.GET.copy()
        filters.pop("page", None)
        context.update(
            page=page, filters=raw, filter_errors=query.errors, filter_query=filters.urlencode(),
            actions=AuditEntry.Action.choices,
            entries=[{"entry": entry, "before": _pretty(entry.before), "after": _pretty(entry.after)}
                     for entry in page.object_list],
        )
        return context


def _pretty(value) -> str:
    return "" if value is None else json.dumps(value, indent=2, sort_keys=True)


class PageJsonView(APIView):
    """An endpoint of a page's script: DRF's request cycle with the browser's session only (a token is for
    the API), the project's role permission and its error shape. These are no part of the REST API and
    stay out of its schema."""

    authentication_classes = [PageSessionAuthentication]
    renderer_classes = [JSONRenderer]
    write_role = Role.VIEWER  # a POST here is a dry run: any role may ask, nothing is written


@extend_schema(exclude=True)
class SpecCheckView(PageJsonView):
    """Dry run of an edit: the schema's errors by field path and the diff against the live revision.

    POST ``{"spec": {...}}`` → ``{"valid", "errors": {path: [messages]}, "against", "changes", "sha256"}``;
    nothing is written. The same ``validate_policy`` judges the spec when the API creates the revision.
    """

    # The editor checks on every edit and the check writes nothing: not counted as a write.
    throttle_classes = []

    def post(self, request, pool):
        body = validated(SpecCheckInputSerializer, request.data)
        check = checks.spec_check(pool=policy_selectors.pool_get(name=pool), spec=body["spec"])
        return Response(check.to_dict())


@extend_schema(exclude=True)
class EditingUploadView(PageJsonView):
    """Directions as NumPy arrays → the ``editing`` section, validated by the schema; nothing is written.

    POST multipart: ``file`` (``.npy`` [n_edits, head_dim] or ``.npz``, see ``relay_engine.core.editing_io``),
    ``rows`` (for ``.npy``: one ``layer head alpha`` line per row), ``num_layers``, ``num_heads``,
    ``head_dim``, ``scope``, ``provenance`` (JSON). → ``{"valid", "errors", "editing", "content_hash"}``;
    an invalid upload is a 400 with its errors by field path, in the API's error shape. The page puts a
    valid section into the form, where the dry-run check diffs it and publishing sends it through the
    API like any other edit.
    """

    parser_classes = [MultiPartParser]
    throttle_classes = [UploadRateThrottle]

    def throttled(self, request, wait):
        raise Throttled(wait, detail=f"Too many uploads: at most {UploadRateThrottle().get_rate()} per user.")

    def post(self, request, pool):
        pool_obj = policy_selectors.pool_get(name=pool)
        fields = validated(EditingUploadInputSerializer, request.data)
        upload = fields["file"]
        result = checks.editing_upload_check(
            pool=pool_obj, name=upload.name, data=upload.read(), rows=fields["rows"],
            fingerprint={key: fields[key] for key in checks.FINGERPRINT_KEYS},
            scope=fields["scope"], provenance=fields["provenance"],
        )
        if not result.valid:
            raise ValidationError(result.errors)
        return Response(result.to_dict())
