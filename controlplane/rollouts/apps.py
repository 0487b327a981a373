from django.apps import AppConfig


class RolloutsConfig(AppConfig):
    name = "controlplane.rollouts"
    label = "rollouts"
    default_auto_field = "django.db.models.BigAutoField"
