"""Signals other apps listen to, so policies never imports them.

``revision_published``: a new generation became the pool's desired one (a publish, a rollback, a
canary's promotion). Sent after the publish committed, with ``send_robust``: a failing receiver is
logged and never undoes or breaks the publish. Arguments: ``pool``, ``generation``, ``published_at``
(the pool's ``desired_at``), ``actor``, ``via`` ("publish" or "canary").
"""

from __future__ import annotations

from django.dispatch import Signal

revision_published = Signal()
