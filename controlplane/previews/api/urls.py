from django.urls import path

from . import views

urlpatterns = [
    path("pools/<poolname:pool>/traffic/", views.PoolTrafficView.as_view(), name="pool-traffic"),
    path("pools/<poolname:pool>/cache-curves/", views.PoolCacheCurvesView.as_view(), name="pool-cache-curves"),
    path("pools/<poolname:pool>/revisions/<generation:generation>/preview/", views.RevisionPreviewView.as_view(),
         name="revision-preview"),
    path("pools/<poolname:pool>/previews/scores/", views.PreviewScoresView.as_view(), name="preview-scores"),
    path("pools/<poolname:pool>/previews/<generation:preview>/", views.PreviewDetailView.as_view(),
         name="preview-detail"),
]
