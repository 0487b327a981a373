from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "controlplane.accounts"
    label = "accounts"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import schema  # noqa: F401 - registers the OpenAPI extension
