"""``python -m relay_engine.import_gr CHECKPOINT --num-heads H --out weights.pt``: a trained HSTU of
Meta's generative-recommenders as RelayGR weights (``relay_engine.lab.gr_import``)."""

import sys

from relay_engine.lab.gr_import import main

if __name__ == "__main__":
    sys.exit(main())
