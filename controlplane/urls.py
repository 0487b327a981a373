"""URL map: the REST API under /api/v1/, its OpenAPI schema and docs, Prometheus at /metrics."""

from django.http import JsonResponse
from django.urls import include, path, register_converter
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerView

from controlplane.common.urls import GenerationConverter, PoolNameConverter
from controlplane.telemetry.api.views import PrometheusMetricsView

register_converter(PoolNameConverter, "poolname")
register_converter(GenerationConverter, "generation")

api_v1 = [
    path("", include("controlplane.policies.api.urls")),
    path("", include("controlplane.fleet.api.urls")),
    path("", include("controlplane.telemetry.api.urls")),
    path("", include("controlplane.accounts.api.urls")),
]

urlpatterns = [
    path("api/v1/", include(api_v1)),
    path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
    path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="swagger-ui"),
    path("api/redoc/", SpectacularRedocView.as_view(url_name="schema"), name="redoc"),
    path("api/auth/", include("rest_framework.urls")),
    path("metrics", PrometheusMetricsView.as_view(), name="prometheus-metrics"),
    path("", include("frontend.urls")),
]


def not_found(request, exception=None):
    return JsonResponse({"detail": f"No such resource: {request.path}"}, status=404)


def server_error(request):
    return JsonResponse({"detail": "Internal error; the request id in X-Request-ID identifies it in the logs."},
                        status=500)


handler404 = not_found
handler500 = server_error
