"""``python -m relay_engine.traffic``: generate or check a trace (``relay_engine.lab.traffic``)."""

import sys

from relay_engine.lab.traffic import main

if __name__ == "__main__":
    sys.exit(main())
