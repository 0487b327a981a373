"""plotly.js from the installed ``plotly`` package, so the pages work on a network with no internet.

The bundle (~4.6 MB) is read and gzipped once per process; its URL carries the package version, so
browsers may cache it for a year and a plotly upgrade is a new URL.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import re
from dataclasses import dataclass
from functools import cache

import plotly
from django.http import HttpRequest, HttpResponse, HttpResponseNotModified
from django.views.decorators.http import require_GET

PLOTLY_VERSION = plotly.__version__
CACHE_SECONDS = 365 * 24 * 3600


@dataclass(frozen=True)
class Bundle:
    raw: bytes
    gzipped: bytes
    etag: str


@cache
def plotly_bundle() -> Bundle:
    raw = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return Bundle(raw=raw, gzipped=gzip.compress(raw, compresslevel=6, mtime=0),
                  etag=f'"plotly-{PLOTLY_VERSION}-{hashlib.sha256(raw).hexdigest()[:16]}"')


@cache
def plotly_style_sources() -> list[str]:
    """Content-Security-Policy sources for the ``<style>`` elements plotly.js writes itself, by hash, so
    that chart pages need no 'unsafe-inline': the empty one it fills through the CSSOM (its modebar and
    hover rules), and each stylesheet whose text the bundle carries verbatim (maplibre's)."""
    texts = [""] + _BUNDLED_STYLE.findall(plotly_bundle().raw.decode())
    return [f"'sha256-{base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()}'"
            for text in dict.fromkeys(texts)]


# createElement("style"); <var>.id="…", <var>.textContent='<css>' in the minified bundle.
_BUNDLED_STYLE = re.compile(r"""createElement\("style"\);[^;]{0,200}?\.textContent='([^'\\]*)'""")


@require_GET
def plotly_js(request: HttpRequest) -> HttpResponse:
    bundle = plotly_bundle()
    if request.headers.get("If-None-Match") == bundle.etag:
        return HttpResponseNotModified(headers={"ETag": bundle.etag})
    use_gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    response = HttpResponse(bundle.gzipped if use_gzip else bundle.raw,
                            content_type="text/javascript; charset=utf-8")
    if use_gzip:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["ETag"] = bundle.etag
    response["Cache-Control"] = f"public, max-age={CACHE_SECONDS}, immutable"
    return response
