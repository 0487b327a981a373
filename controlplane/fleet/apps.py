from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "controlplane.fleet"
    label = "fleet"
