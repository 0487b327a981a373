"""Input of the pages' JSON endpoints (``views.SpecCheckView``, ``views.EditingUploadView``)."""

from __future__ import annotations

from rest_framework import serializers


class SpecCheckInputSerializer(serializers.Serializer):
    # Any JSON value: the policy schema judges it and names every error by field path.
    spec = serializers.JSONField(allow_null=True)


def _form_text() -> serializers.CharField:
    # As typed: the upload's parser names what is wrong with a value, blank meaning "not given".
    return serializers.CharField(required=False, default="", allow_blank=True, trim_whitespace=False)


class EditingUploadInputSerializer(serializers.Serializer):
    file = serializers.FileField(allow_empty_file=True, error_messages={
        "required": "is required: an .npy or .npz file", "invalid": "must be an .npy or .npz file"})
    rows = _form_text()
    num_layers = _form_text()
    num_heads = _form_text()
    head_dim = _form_text()
    scope = _form_text()
    provenance = _form_text()
