from django.urls import path

from . import views

urlpatterns = [
    path("me/", views.MeView.as_view(), name="me"),
    path("users/", views.UserListView.as_view(), name="user-list"),
    path("tokens/", views.TokenListView.as_view(), name="token-list"),
    path("tokens/<generation:token_id>/", views.TokenDetailView.as_view(), name="token-detail"),
]
