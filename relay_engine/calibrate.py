"""``python -m relay_engine.calibrate``: this machine's time scale K and cost model (``relay_engine.lab.calibrate``)."""

import sys

from relay_engine.lab.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
