from django.apps import AppConfig


class PreviewsConfig(AppConfig):
    name = "controlplane.previews"
    label = "previews"
    verbose_name = "Traffic capture and what-if previews"
    default_auto_field = "django.db.models.BigAutoField"
