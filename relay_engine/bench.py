"""``python -m relay_engine.bench``: relay vs full inference at a fixed P99 SLO (``relay_engine.lab.bench``)."""

import sys

from relay_engine.lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
