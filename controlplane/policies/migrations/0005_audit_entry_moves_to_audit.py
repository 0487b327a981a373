"""The audit log moved to the shared ``audit`` app (its 0001): this app lets go of the model's state;
the table and its rows are the audit app's now, unchanged."""

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ("policies", "0004_audit_previews_and_traffic_downloads"),
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="AuditEntry")],
            database_operations=[],
        ),
    ]
