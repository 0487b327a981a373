"""``python -m relay_engine.profile``: per-operation timings of the model (``relay_engine.lab.profile``)."""

import sys

from relay_engine.lab.profile import main

if __name__ == "__main__":
    sys.exit(main())
