"""Pages at the site root; the pool path converter is registered by ``controlplane.urls``."""

from django.contrib.auth import views as auth_views
from django.urls import path

from . import assets, views

app_name = "frontend"

urlpatterns = [
    path("", views.OverviewView.as_view(), name="overview"),
    path("login/", auth_views.LoginView.as_view(template_name="frontend/login.html", redirect_authenticated_user=True),
         name="login"),
    path("logout/", auth_views.LogoutView.as_view(next_page="frontend:login"), name="logout"),
    path("audit/", views.AuditView.as_view(), name="audit"),
    path("pools/<poolname:pool>/", views.LiveView.as_view(), name="live"),
    path("pools/<poolname:pool>/instances/<instancename:instance>/", views.InstanceView.as_view(), name="instance"),
    path("pools/<poolname:pool>/config/", views.ConfigView.as_view(), name="config"),
    path("pools/<poolname:pool>/fleet/", views.FleetView.as_view(), name="fleet"),
    path("ui/pools/<poolname:pool>/check/", views.SpecCheckView.as_view(), name="spec-check"),
    path("ui/pools/<poolname:pool>/editing-upload/", views.EditingUploadView.as_view(), name="editing-upload"),
    path("vendor/plotly.min.js", assets.plotly_js, name="plotly-js"),
    path("vendor/redoc.standalone.js", assets.redoc_js, name="redoc-js"),
    path("favicon.ico", assets.no_icon, name="favicon"),
]
