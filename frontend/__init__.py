"""The browser side of the control plane: server-rendered pages whose scripts call the REST API.

Pages: SLO overview, pool live view, config editor, fleet, audit log, login/logout. Charts use the
plotly.js bundled in the installed ``plotly`` Python package (``assets.plotly_js``), never a CDN.
"""
