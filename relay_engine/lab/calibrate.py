"""This machine against the reference device: the time scale K and the cost model, for a stack.

    python -m relay_engine.calibrate --out var/calibration.json [--threads 1]
                                     [--weights FILE | --model-config JSON]
                                     [--profile-out var/profile-cpu.json] [--repeats 3]

``make run`` runs this once per data directory (it reuses the file while the machine, torch and the
model are the same). It measures the default model's forwards here, as the instances run them (one
torch thread each on a CPU), and fits the cost model (``relay_engine.lab.profile.fit_profile``).

- **K** compares that with the stated reference accelerator (``profiles/reference.json``), as the
  benchmark's ``--time-scale auto`` does: K = 5 means this machine runs the forwards five times
  slower. The stack then gives its demo pool the reference regime's latency constants × K — the
  ranking SLO, the ranking deadline and the retrieval→ranking gap — so a CPU shows the same ratios
  of compute to time budget as the device the product is for, and says so.
- **The cost model** of the pool's own model is written to ``--profile-out``: what the what-if
  previews of that pool replay with (not the reference profile, which would predict an
  accelerator's times for a CPU pool); and its full-inference latency model (``latency_model``),
  which the stack gives the demo pool's trigger: without one, a rank that joined a prefill in flight
  waits for it up to its deadline; with this machine's, it recomputes while a recompute still fits.

Both are measured standalone (one request alone on the compute); queueing is the simulator's.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from relay_engine.core import devices
from relay_engine.core.fields import argument
from relay_engine.core.model import HSTUModel, ModelConfig, WeightsFileError
from relay_engine.lab.bench.settings import REFERENCE_PROFILE
from relay_engine.lab.costmodel import PROFILE_LENGTHS, CostModel, time_scale_against
from relay_engine.lab.profile import fit_profile

FORMAT = "relaygr-calibration/1"
# The shape K is judged at: the profile's default (32 short-term tokens, 128 candidates).
SHORT, CANDIDATES = 32, 128


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def identity(threads: int, model_version: str) -> dict:
    """What a calibration is valid for: the same machine, torch, threads and model give the same K."""
    return {"format": FORMAT, "cpu": cpu_name(), "machine": platform.machine(), "torch": torch.__version__,
            "threads": threads, "model_version": model_version}


def pool_model(weights: str | None, config_json: str | None) -> HSTUModel | None:
    """The pool's model when it is not the default one: a weights file, or a preset's config."""
    if weights:
        return HSTUModel.load(weights)
    if config_json:
        config = ModelConfig(**json.loads(config_json))
        return None if config == ModelConfig() else HSTUModel(config)
    return None


def calibrate(*, threads: int, model: HSTUModel | None, repeats: int, profile_out: Path) -> dict:
    devices.keep_freed_host_memory()
    torch.set_num_threads(threads)
    started = time.monotonic()
    default = HSTUModel(ModelConfig())
    cost = fit_profile(default, default.config, default.device, PROFILE_LENGTHS, SHORT, CANDIDATES, repeats,
                       quiet=True)
    reference = CostModel.load(REFERENCE_PROFILE)
    k = time_scale_against(cost, reference, short=SHORT, candidates=CANDIDATES)
    if model is None:
        model = default
    else:  # the lengths the pool's model takes (a small one may stop short of 4,096 tokens)
        lengths = [n for n in PROFILE_LENGTHS if n + SHORT <= model.config.max_seq_len]
        cost = fit_profile(model, model.config, model.device, lengths, SHORT, CANDIDATES, repeats, quiet=True)
    cost.save(profile_out)
    return {
        **identity(threads, model.version),
        "time_scale": round(k, 3),
        "how": "geometric mean of measured ÷ reference forward times (prefill, cached rank, full rank at "
               f"512…4096 tokens, {SHORT} short-term tokens, {CANDIDATES} candidates), default model, "
               f"{threads} torch thread(s), median thread CPU time of {repeats} repeats",
        "reference_note": reference.note,
        "profile": str(profile_out),
        "profile_fit_max_relative_error": cost.fit_errors(),
        # The trigger's full-inference latency model on this machine (trigger.latency_model): how long a
        # recompute takes here, so a rank waiting on a prefill in flight gives up while one still fits.
        "latency_model": asdict(cost.full_inference_model(SHORT, CANDIDATES)),
        "rank_full_ms_2048": round(cost.op_ms("rank_full", 2048, SHORT, CANDIDATES), 2),
        "rank_full_ms_2048_reference": round(reference.op_ms("rank_full", 2048, SHORT, CANDIDATES), 2),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "measured_in_s": round(time.monotonic() - started, 1),
        "model": asdict(model.config),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="the calibration (JSON) to write")
    parser.add_argument("--profile-out", type=Path, help="the pool model's cost model (default: next to --out, "
                                                        "profile-cpu.json)")
    parser.add_argument("--threads", type=argument(1, 256, as_int=True), default=1, help="torch threads per instance (default 1)")
    parser.add_argument("--weights", help="the pool's weights file (python -m relay_engine.import_gr); "
                                          "default: the default model")
    parser.add_argument("--model-config", help="the pool's model as ModelConfig fields (JSON), for a preset")
    parser.add_argument("--repeats", type=argument(1, 50, as_int=True), default=3, help="repeats per measured point (default 3)")
    args = parser.parse_args(argv)
    profile_out = args.profile_out or args.out.parent / "profile-cpu.json"
    try:
        model = pool_model(args.weights, args.model_config)
    except WeightsFileError as exc:
        print(f"error: --weights: {exc}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:
        print(f"error: --model-config: {exc}", file=sys.stderr)
        return 2
    result = calibrate(threads=args.threads, model=model, repeats=args.repeats, profile_out=profile_out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({key: result[key] for key in ("time_scale", "rank_full_ms_2048", "rank_full_ms_2048_reference",
                                                   "measured_in_s")}))
    return 0
