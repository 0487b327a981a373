from django.urls import path

from . import views

urlpatterns = [
    path("pools/", views.PoolListView.as_view(), name="pool-list"),
    path("pools/<poolname:pool>/", views.PoolDetailView.as_view(), name="pool-detail"),
    path("pools/<poolname:pool>/revisions/", views.RevisionListView.as_view(), name="revision-list"),
    path("pools/<poolname:pool>/revisions/<generation:generation>/", views.RevisionDetailView.as_view(),
         name="revision-detail"),
    path("pools/<poolname:pool>/revisions/<generation:generation>/diff/", views.RevisionDiffView.as_view(),
         name="revision-diff"),
    path("pools/<poolname:pool>/revisions/<generation:generation>/publish/", views.RevisionPublishView.as_view(),
         name="revision-publish"),
    path("pools/<poolname:pool>/rollback/", views.PoolRollbackView.as_view(), name="pool-rollback"),
]
