from django.apps import AppConfig


class TelemetryConfig(AppConfig):
    name = "controlplane.telemetry"
    label = "telemetry"
