"""URL map: the REST API under /api/v1/, its OpenAPI schema and docs, Prometheus at /metrics, the
health probe at /healthz."""

from csp.decorators import csp_replace, csp_update
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.http import JsonResponse
from django.urls import include, path, register_converter
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerSplitView

from controlplane.common.health import healthz
from controlplane.common.renderers import INLINE_STYLES, REDOC_WORKERS
from controlplane.common.urls import GenerationConverter, InstanceNameConverter, PoolNameConverter
from controlplane.telemetry.api.views import PrometheusMetricsView

register_converter(PoolNameConverter, "poolname")
register_converter(GenerationConverter, "generation")
register_converter(InstanceNameConverter, "instancename")

api_v1 = [
    path("", include("controlplane.policies.api.urls")),
    path("", include("controlplane.fleet.api.urls")),
    path("", include("controlplane.telemetry.api.urls")),
    path("", include("controlplane.rollouts.api.urls")),
    path("", include("controlplane.previews.api.urls")),
    path("", include("controlplane.accounts.api.urls")),
    path("", include("controlplane.audit.api.urls")),
]

# The browsable API's log-in and log-out links (DRF's ``rest_framework.urls``, whose logout renders
# ``registration/logged_out.html``, a template only django.contrib.admin ships: a 500 here). Logging
# out lands on the site's login page instead.
api_auth = ([
    path("login/", csp_update(INLINE_STYLES)(auth_views.LoginView.as_view(template_name="rest_framework/login.html")),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page=settings.LOGIN_URL), name="logout"),
], "rest_framework")

urlpatterns = [
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerSplitView.as_view(url_name="schema", template_name="api_docs/swagger_ui.html"),
         name="swagger-ui"),
    path("api/redoc/", csp_replace(REDOC_WORKERS)(csp_update(INLINE_STYLES)(
        SpectacularRedocView.as_view(url_name="schema", template_name="frontend/redoc.html"))), name="redoc"),
    path("api/auth/", include(api_auth)),
    path("metrics", PrometheusMetricsView.as_view(), name="prometheus-metrics"),
    path("healthz", healthz, name="healthz"),
    path("", include("frontend.urls")),
]


def not_found(request, exception=None):
    return JsonResponse({"detail": f"No such resource: {request.path}"}, status=404)


def server_error(request):
    """What a 500 shows (with DEBUG off, as everywhere but ``--debug`` on loopback): no settings, no stack."""
    request_id = getattr(request, "request_id", None)
    return JsonResponse({"detail": f"Internal error; the request id {request_id} identifies it in the logs.",
                         "request_id": request_id}, status=500)


handler404 = not_found
handler500 = server_error
