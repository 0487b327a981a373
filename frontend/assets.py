"""Scripts the pages load, served from installed packages so they work on a network with no internet.

- plotly.js from the ``plotly`` package (~4.6 MB): its URL carries the package version, so browsers
  may cache it for a year and a plotly upgrade is a new URL.
- ReDoc from ``drf-spectacular-sidecar``, without the one address outside this server it loads by
  itself (the "API docs by Redocly" credit's logo, from cdn.redoc.ly: the credit stays, as text).
  Browsers revalidate it (its URL is the one the ReDoc page names).

Each bundle is read and gzipped once per process.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import importlib.resources
import re
from dataclasses import dataclass
from functools import cache
from importlib.metadata import version

import plotly
from django.http import HttpRequest, HttpResponse, HttpResponseNotModified
from django.views.decorators.http import require_GET

PLOTLY_VERSION = plotly.__version__
CACHE_SECONDS = 365 * 24 * 3600
REDOC_CREDIT_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"


@dataclass(frozen=True)
class Bundle:
    raw: bytes
    gzipped: bytes
    etag: str


def _bundle(name: str, package_version: str, raw: bytes) -> Bundle:
    return Bundle(raw=raw, gzipped=gzip.compress(raw, compresslevel=6, mtime=0),
                  etag=f'"{name}-{package_version}-{hashlib.sha256(raw).hexdigest()[:16]}"')


@cache
def plotly_bundle() -> Bundle:
    raw = (importlib.resources.files("plotly") / "package_data" / "plotly.min.js").read_bytes()
    return _bundle("plotly", PLOTLY_VERSION, raw)


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


@cache
def redoc_bundle() -> Bundle:
    raw = (importlib.resources.files("drf_spectacular_sidecar") / "static" / "drf_spectacular_sidecar" / "redoc"
           / "bundles" / "redoc.standalone.js").read_bytes()
    # An <img> with no src loads nothing; ReDoc's onError then leaves the logo out.
    return _bundle("redoc", version("drf-spectacular-sidecar"), raw.replace(REDOC_CREDIT_LOGO, b""))


def _served(request: HttpRequest, bundle: Bundle, cache_control: str) -> HttpResponse:
    if request.headers.get("If-None-Match") == bundle.etag:
        return HttpResponseNotModified(headers={"ETag": bundle.etag})
    use_gzip = "gzip" in request.headers.get("Accept-Encoding", "")
    response = HttpResponse(bundle.gzipped if use_gzip else bundle.raw,
                            content_type="text/javascript; charset=utf-8")
    if use_gzip:
        response["Content-Encoding"] = "gzip"
    response["Vary"] = "Accept-Encoding"
    response["ETag"] = bundle.etag
    response["Cache-Control"] = cache_control
    return response


@require_GET
def plotly_js(request: HttpRequest) -> HttpResponse:
    return _served(request, plotly_bundle(), f"public, max-age={CACHE_SECONDS}, immutable")


@require_GET
def redoc_js(request: HttpRequest) -> HttpResponse:
    return _served(request, redoc_bundle(), "public, no-cache")


@require_GET
def no_icon(request: HttpRequest) -> HttpResponse:
    """The site has no icon: the pages that name none (the browsable API's) get an empty answer, not a
    404 their console reports."""
    return HttpResponse(status=204, headers={"Cache-Control": f"public, max-age={CACHE_SECONDS}"})
