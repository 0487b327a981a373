"""The browsable API (HTML for people exploring the API in a browser), under the Content-Security-Policy."""

from __future__ import annotations

from csp.decorators import csp_update
from rest_framework.renderers import BrowsableAPIRenderer

# What the third-party pages under /api/ need on top of the site's policy: DRF's browsable API and its
# log-in page style elements by attribute, ReDoc writes <style> elements at run time (styled-components).
# Inline styles there, and only there; scripts stay 'self' everywhere.
INLINE_STYLES = {"style-src": ["'unsafe-inline'"]}
# ReDoc also runs its search index in a web worker it makes from a blob: URL: worker-src is *replaced*
# ('none' beside a source is an invalid directive that Chromium reports and ignores).
REDOC_WORKERS = {"worker-src": ["blob:"]}


class BrowsableAPIWithoutFilterForms(BrowsableAPIRenderer):
    """DRF's browsable API, allowed its inline styles, without its filter form: no view here has
    filter backends, and building the form asks each list view for ``get_queryset()``, which ours do
    not define (they page a selector's queryset), so every list page in a browser was a 500."""

    def get_filter_form(self, data, view, request):
        return None

    def render(self, data, accepted_media_type=None, renderer_context=None):
        html = super().render(data, accepted_media_type, renderer_context)
        response = (renderer_context or {}).get("response")
        if response is not None:
            csp_update(INLINE_STYLES)(lambda: response)()
        return html
