from django.urls import path

from . import views

urlpatterns = [
    path("pools/<poolname:pool>/rollout/", views.RolloutView.as_view(), name="rollout-detail"),
    path("pools/<poolname:pool>/rollout/promote/", views.RolloutPromoteView.as_view(), name="rollout-promote"),
    path("pools/<poolname:pool>/rollout/abort/", views.RolloutAbortView.as_view(), name="rollout-abort"),
]
