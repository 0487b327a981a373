"""Content negotiation where an explicit ``?format=`` wins over the Accept header.

DRF's default refuses with 406 when the format asked for in the URL is not also acceptable by the
Accept header, so a script that always sends ``Accept: application/json`` cannot download
``?format=jsonl``. A format named in the URL is the caller's explicit choice: it is served. Without
one, the Accept header decides as usual (and the browsable API answers a browser)."""

from __future__ import annotations

from rest_framework.negotiation import DefaultContentNegotiation


class FormatWinsNegotiation(DefaultContentNegotiation):
    def select_renderer(self, request, renderers, format_suffix=None):
        fmt = format_suffix or request.query_params.get(self.settings.URL_FORMAT_OVERRIDE)
        if fmt:
            named = self.filter_renderers(renderers, fmt)  # Http404 for a format no renderer has
            return named[0], named[0].media_type
        return super().select_renderer(request, renderers, format_suffix)
