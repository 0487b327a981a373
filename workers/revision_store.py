"""The last revision an instance applied, kept on its local disk, so a restart does not depend on Redis.

Redis runs without persistence: after it restarts empty the desired revision is back only when the
control plane's sync loop rewrites it (every 10 s). An instance starting in that window starts from
this file instead of the schema's defaults. One file per instance:
``<RELAYGR_DATA_DIR>/<key prefix>/<pool>.<index>.json``, holding the ``DesiredRevision`` record as it
was applied. It is written atomically (a temporary file in the same folder, flushed to disk, renamed
over the old one), so a crash mid-write leaves the previous revision, never half of one. What is read
back is judged like anything from Redis: decoded strictly, validated and its sha256 checked by the
reconciler before it is applied.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from pathlib import Path

from relay_engine.core.wire import DesiredRevision, WireError

log = logging.getLogger(__name__)

# A record holds one spec (editing directions included): far below this. A bigger file is not ours.
MAX_RECORD_BYTES = 64 * 1024 * 1024


class RevisionStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    def load(self) -> DesiredRevision | None:
        """The stored record, or None when there is none or it cannot be read (logged)."""
        try:
            if self.path.stat().st_size > MAX_RECORD_BYTES:
                raise WireError(f"is larger than {MAX_RECORD_BYTES} bytes")
            return DesiredRevision.from_json(self.path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, WireError) as exc:
            log.warning("ignoring the last applied revision in %s: %s", self.path, exc)
            return None

    def save(self, revision: DesiredRevision) -> bool:
        """Replace the stored record with ``revision``; False (logged) when the disk refuses."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(revision.to_json())
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            _fsync_dir(self.path.parent)  # the rename itself survives a power loss
            return True
        except OSError as exc:
            log.warning("could not keep generation %d on disk at %s: %s", revision.generation, self.path, exc)
            return False


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not every filesystem lets a folder be opened for this
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
