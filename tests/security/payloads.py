"""Payloads an attacker who can write to Redis would plant there."""

from __future__ import annotations

import pickle
from pathlib import Path


class CreatesFileWhenUnpickled:
    """Harmless to build and to pickle; loading its pickle creates ``path``: if the file exists, some
    process unpickled what was planted."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def pickle_that_creates(path: Path) -> bytes:
    return pickle.dumps(CreatesFileWhenUnpickled(path))
