from django.apps import AppConfig


class PreviewsConfig(AppConfig):
    name = "controlplane.previews"
    label = "previews"
    verbose_name = "Traffic capture and what-if previews"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # A published revision that had a preview gets a score (``scoring``); policies never imports us.
        from controlplane.policies.signals import revision_published

        from . import scoring

        revision_published.connect(scoring.on_revision_published, dispatch_uid="previews.score_on_publish")
