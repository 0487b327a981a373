"""The RelayGR control plane: pools, immutable config revisions, publishing, fleet status, telemetry.

Meets the worker fleet only in Redis, through ``relay_engine.core.wire``; never imports ``workers``.
"""
