from django.contrib.auth import get_user_model
from django.db.models import QuerySet

from controlplane.common.errors import NotFound

from .models import ApiToken


def user_list() -> QuerySet:
    return get_user_model().objects.prefetch_related("groups").order_by("username")


def user_get(*, username: str):
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise NotFound(f"User {username!r} does not exist.", errors={"username": ["no such user"]})
    return user


def token_list() -> QuerySet[ApiToken]:
    return ApiToken.objects.select_related("user").order_by("id")
