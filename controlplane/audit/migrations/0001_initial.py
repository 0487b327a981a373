"""The audit log moves here from ``policies``: only Django's state of the model moves; the table
(``policies_auditentry``), its indexes and its rows stay as they are (``policies`` 0005 lets go of it)."""

from django.db import migrations, models

MODEL = "auditentry"


def _content_type_moves(apps, old: str, new: str) -> None:
    """The model's content type follows it, unless the new app has one already."""
    content_type = apps.get_model("contenttypes", "ContentType")
    if not content_type.objects.filter(app_label=new, model=MODEL).exists():
        content_type.objects.filter(app_label=old, model=MODEL).update(app_label=new)


def forwards(apps, schema_editor):
    _content_type_moves(apps, "policies", "audit")


def backwards(apps, schema_editor):
    _content_type_moves(apps, "audit", "policies")


class Migration(migrations.Migration):

    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("policies", "0004_audit_previews_and_traffic_downloads"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AuditEntry",
                    fields=[
                        ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                        ("time", models.DateTimeField(auto_now_add=True, db_index=True)),
                        ("actor", models.CharField(max_length=150)),
                        ("request_id", models.CharField(blank=True, default="", max_length=64)),
                        ("action", models.CharField(choices=[
                            ("pool.create", "Pool Create"), ("revision.create", "Revision Create"),
                            ("revision.publish", "Revision Publish"), ("pool.rollback", "Pool Rollback"),
                            ("rollout.start", "Rollout Start"), ("rollout.promote", "Rollout Promote"),
                            ("rollout.rollback", "Rollout Rollback"), ("rollout.abort", "Rollout Abort"),
                            ("user.create", "User Create"), ("user.role", "User Role"),
                            ("token.create", "Token Create"), ("token.revoke", "Token Revoke"),
                            ("preview.start", "Preview Start"), ("traffic.download", "Traffic Download"),
                        ], max_length=32)),
                        ("object_type", models.CharField(max_length=32)),
                        ("object_id", models.CharField(max_length=200)),
                        ("pool", models.CharField(blank=True, db_index=True, default="", max_length=63)),
                        ("before", models.JSONField(blank=True, null=True)),
                        ("after", models.JSONField(blank=True, null=True)),
                    ],
                    options={
                        "db_table": "policies_auditentry",
                        "ordering": ["-time", "-id"],
                        "indexes": [
                            models.Index(fields=["pool", "time"], name="policies_au_pool_fe5a90_idx"),
                            models.Index(fields=["action", "time"], name="policies_au_action_869f55_idx"),
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(forwards, backwards),
    ]
