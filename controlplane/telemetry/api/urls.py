from django.urls import path

from . import views

urlpatterns = [
    path("pools/<poolname:pool>/metrics/", views.PoolMetricsView.as_view(), name="pool-metrics"),
    path("pools/<poolname:pool>/forwards/", views.PoolForwardTimesView.as_view(), name="pool-forward-times"),
    path("pools/<poolname:pool>/instances/", views.InstanceTableView.as_view(), name="pool-instances"),
    path("pools/<poolname:pool>/instances/<instancename:instance>/metrics/", views.InstanceMetricsView.as_view(),
         name="instance-metrics"),
]
