from django.urls import path

from . import views

urlpatterns = [
    path("pools/<poolname:pool>/metrics/", views.PoolMetricsView.as_view(), name="pool-metrics"),
]
