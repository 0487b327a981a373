"""``python -m relay_engine.sim``: the calibrated fleet simulator (``relay_engine.lab.sim``)."""

import sys

from relay_engine.lab.sim.cli import main

if __name__ == "__main__":
    sys.exit(main())
