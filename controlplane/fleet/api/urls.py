from django.urls import path

from . import views

urlpatterns = [
    path("pools/<poolname:pool>/status/", views.PoolStatusView.as_view(), name="pool-status"),
    path("pools/<poolname:pool>/instances/<instancename:instance>/", views.InstanceStatusView.as_view(),
         name="instance-status"),
]
