"""The host allocator setting every process that runs forwards makes (``devices.keep_freed_host_memory``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Five prefills of 2048 tokens after one warm-up; prints whether the setting took, then minor page
# faults per prefill. Its own process: the setting is process-wide and cannot be undone.
PREFILLS = '''
import resource, sys
import torch
from relay_engine.core import devices
from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.model import HSTUModel, ModelConfig

kept = devices.keep_freed_host_memory() if sys.argv[1] == "keep" else False
torch.set_num_threads(1)
model = HSTUModel(ModelConfig(num_items=1024))
prefix = SyntheticFeatures(model.config).prefix("user", 2048)
model.prefill(prefix)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    model.prefill(prefix)
print(kept, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
'''


def faults_per_prefill(tmp_path: Path, mode: str) -> tuple[bool, float]:
    script = tmp_path / "prefills.py"
    script.write_text(PREFILLS)
    done = subprocess.run([sys.executable, str(script), mode], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux's")
def test_a_process_that_keeps_freed_memory_reuses_a_forwards_temporaries_instead_of_faulting_them_in(tmp_path):
    kept, faults = faults_per_prefill(tmp_path, "keep")
    assert kept
    # Without the setting each prefill of 2048 tokens faults in 640–5,900 pages (4 KiB) of fresh
    # temporaries, as glibc maps and unmaps them; with it, ~100 (the arenas growing once).
    assert faults < 300
