"""``python -m relay_engine.editing``: the model-editing workflow (``relay_engine.lab.editing``)."""

import sys

from relay_engine.lab.editing.cli import main

if __name__ == "__main__":
    sys.exit(main())
