"""Stored revisions in the schema's canonical form, with the sha256 the workers will recompute.

The schema now gives every number one spelling per value (-0.0 is 0.0; a whole float in editing
provenance is an integer), so a revision stored before with such a number would no longer hash to
its stored sha256, and every worker would refuse it. Each revision is validated again and, where its
normalised spec or sha256 differ, both are rewritten: the same policy, in canonical form. Revisions
already canonical (the great majority) are untouched. The sync loop then writes the desired ones to
Redis again (``relaygr_sync`` overwrites what Redis holds), and workers re-apply the same policy.
"""

from django.db import migrations

from relay_engine.core.config import validate_policy


def canonicalise(apps, schema_editor):
    ConfigRevision = apps.get_model("policies", "ConfigRevision")
    for revision in ConfigRevision.objects.only("pk", "spec", "sha256").iterator():
        spec, errors = validate_policy(revision.spec)
        if errors:
            continue  # not valid by today's schema: left as stored, workers report why they refuse it
        normalised, digest = spec.to_dict(), spec.sha256()
        if digest != revision.sha256 or normalised != revision.spec:
            ConfigRevision.objects.filter(pk=revision.pk).update(spec=normalised, sha256=digest)


class Migration(migrations.Migration):
    dependencies = [("policies", "0001_initial")]
    operations = [migrations.RunPython(canonicalise, migrations.RunPython.noop)]
