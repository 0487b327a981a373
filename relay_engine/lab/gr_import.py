"""Import a trained HSTU from Meta's generative-recommenders (its research encoder) as RelayGR weights.

    python -m relay_engine.import_gr CHECKPOINT --num-heads H --out weights.pt

CHECKPOINT is what the reference's ``train.py`` saves (``{"model_state_dict": ...}``, DDP's
``module.`` prefix allowed) or a bare state dict of its ``HSTU`` module. The state dict does not
say everything the reference ran with: ``train.py``'s file name does (heads, dqk, dv, activation,
item L2 norm: ``HSTU-b8-h2-dqk25-dv25-lsilud0.2-…_local-l2-eps1e-06_…``), else the flags, else the
reference's own defaults and its published configurations. The import configures RelayGR's model to compute what
the reference computes (``docs/model.md`` has the mapping, term by term), or refuses with an
``UnsupportedCheckpoint`` naming the difference it cannot represent. Workers serve the result with
``RELAYGR_MODEL=weights.pt``.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from relay_engine.core.model import HSTUModel, ModelConfig

# The reference's names (``generative_recommenders/research/modeling/sequential/``).
ITEM_EMB = "_embedding_module._item_emb.weight"
POS_EMB = "_input_features_preproc._pos_emb.weight"
ATTN_MASK = "_attn_mask"
LAYER = re.compile(r"^_hstu\._attention_layers\.(\d+)\.(.+)$")
LAYER_PARAMS = ("_uvqk", "_o.weight", "_o.bias", "_rel_attn_bias._ts_w", "_rel_attn_bias._pos_w")
# Parameters of reference variants this importer refuses, and why (their first name that shows them).
REFUSED_PREFIXES = {
    "_ndp_module.": "its similarity module is a learned one (MoL, _ndp_module.*); RelayGR scores by dot "
                    "product, as the reference's DotProduct similarity",
    "_embedding_module._item_id_to_category_id": "its embedding module is CategoricalEmbeddingModule (items "
                                                 "share category embeddings); only LocalEmbeddingModule is "
                                                 "supported",
    "_input_features_preproc._rating_emb": "its input preprocessor embeds ratings (LearnablePositionalEmbedding"
                                           "RatedInputFeaturesPreprocessor or CombinedItemAndRating...); only "
                                           "LearnablePositionalEmbeddingInputFeaturesPreprocessor is supported",
}
# Actions: the reference has no action vocabulary. RelayGR keeps two (0: candidate, 1: an event), both
# embedded as zeros, so tokens read exactly as the reference reads them.
NUM_ACTIONS = 2
REFERENCE_EPS = 1e-6  # its layer norms' epsilon and its L2 norms' floor


class UnsupportedCheckpoint(ValueError):
    """A checkpoint (or a flag) whose semantics RelayGR's model cannot reproduce exactly."""


@dataclass(frozen=True)
class ReferenceSettings:
    """What the reference ran with that its state dict does not record (its gin / train_fn flags)."""

    num_heads: int  # hstu_encoder.num_heads
    user_embedding_norm: str = "l2_norm"  # train_fn.user_embedding_norm: "l2_norm" | "layer_norm"
    item_l2_norm: bool = True  # train_fn.item_l2_norm (true in every published configuration)
    normalization: str = "rel_bias"  # hstu_encoder.normalization
    linear_activation: str = "silu"  # hstu_encoder.linear_activation
    concat_ua: bool = False  # hstu_encoder.concat_ua


# train.py names a checkpoint after its model: ``{model.debug_str()}_{similarity}_{sampling}_…_ep{N}``.
CHECKPOINT_NAME = re.compile(r"HSTU-b(?P<blocks>\d+)-h(?P<heads>\d+)-dqk(?P<dqk>\d+)-dv(?P<dv>\d+)-l(?P<act>[a-z]+)d")


@dataclass(frozen=True)
class NamedModel:
    """What a ``train.py`` checkpoint's file name says about the model."""

    num_blocks: int
    num_heads: int
    dqk: int
    dv: int
    linear_activation: str
    item_l2_norm: bool

    @classmethod
    def of(cls, path: str | Path) -> NamedModel | None:
        m = CHECKPOINT_NAME.search(Path(path).name)
        if m is None:
            return None
        return cls(int(m["blocks"]), int(m["heads"]), int(m["dqk"]), int(m["dv"]), m["act"],
                   "-l2-eps" in Path(path).name)

    def check(self, config: ModelConfig) -> None:
        """Refuse weights whose shapes contradict the name (a renamed file, a wrong --num-heads)."""
        found = (config.num_layers, config.num_heads, config.head_dim, config.head_dim)
        named = (self.num_blocks, self.num_heads, self.dqk, self.dv)
        if found != named:
            raise UnsupportedCheckpoint(f"its name says HSTU-b{named[0]}-h{named[1]}-dqk{named[2]}-dv{named[3]}, "
                                        f"its weights read as b{found[0]}-h{found[1]}-dqk{found[2]}-dv{found[3]}")


def reference_state_dict(checkpoint: object) -> dict[str, torch.Tensor]:
    """The HSTU module's state dict out of a checkpoint as ``train.py`` saves it, or a bare one."""
    state = checkpoint.get("model_state_dict", checkpoint) if isinstance(checkpoint, Mapping) else None
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UnsupportedCheckpoint("not a generative-recommenders checkpoint: expected a state dict of tensors "
                                    "or a dict with 'model_state_dict'")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in state.items()}


def convert(state: Mapping[str, torch.Tensor], settings: ReferenceSettings) -> tuple[ModelConfig, dict]:
    """RelayGR's (config, state_dict) computing what the reference computes with these weights."""
    _check_settings(settings)
    for name in state:
        for prefix, why in REFUSED_PREFIXES.items():
            if name.startswith(prefix):
                raise UnsupportedCheckpoint(f"{name}: {why}")
    used: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in state:
            raise UnsupportedCheckpoint(f"missing {name}: not a checkpoint of the research HSTU encoder")
        used.add(name)
        return state[name].detach().to("cpu", torch.float32)

    items = take(ITEM_EMB)  # [num_items + 1, E]; row 0 is padding
    positions = take(POS_EMB)  # [N, E]
    n_rows, E = items.shape
    N = positions.shape[0]  # max_sequence_len + max_output_len: the padded length every input has
    if positions.shape[1] != E:
        raise UnsupportedCheckpoint(f"{POS_EMB} has width {positions.shape[1]}, the item embeddings {E}")
    if ATTN_MASK in state:
        used.add(ATTN_MASK)
        if tuple(state[ATTN_MASK].shape) != (N, N):
            raise UnsupportedCheckpoint(f"{ATTN_MASK} is {list(state[ATTN_MASK].shape)}, the position table "
                                        f"says the sequence length is {N}")
    indices = sorted({int(m.group(1)) for m in map(LAYER.match, state) if m})
    if not indices or indices != list(range(len(indices))):
        raise UnsupportedCheckpoint(f"expected layers _hstu._attention_layers.0…n−1, found indices {indices}")
    for i in indices:
        absent = [n for n in LAYER_PARAMS if f"_hstu._attention_layers.{i}.{n}" not in state]
        if any(n.startswith("_rel_attn_bias.") for n in absent):
            raise UnsupportedCheckpoint(
                f"layer {i} has no time-and-position bias (_rel_attn_bias._ts_w/_pos_w; "
                f"enable_relative_attention_bias=False?): the reference's rel_bias attention cannot run without it")
        if absent:
            raise UnsupportedCheckpoint(f"missing _hstu._attention_layers.{i}.{absent[0]}")

    H = settings.num_heads
    uvqk0, out0 = state["_hstu._attention_layers.0._uvqk"], state["_hstu._attention_layers.0._o.weight"]
    if out0.shape[1] % H:
        raise UnsupportedCheckpoint(f"_o.weight has {out0.shape[1]} inputs, not a multiple of --num-heads {H}")
    dv = out0.shape[1] // H
    dqk2 = uvqk0.shape[1] - 2 * dv * H  # 2·H·dqk
    if dqk2 <= 0 or dqk2 % (2 * H):
        raise UnsupportedCheckpoint(f"_uvqk has {uvqk0.shape[1]} outputs, which is not 2·H·(dv + dqk) for "
                                    f"H={H}, dv={dv}; check --num-heads")
    dqk = dqk2 // (2 * H)
    if dqk != dv:
        raise UnsupportedCheckpoint(f"its Q/K head dimension (dqk={dqk}) differs from its U/V one (dv={dv}); "
                                    f"RelayGR caches K and V in one [layers, 2, H, T, D] tensor and needs dqk == dv")

    n_time = None
    ours: dict[str, torch.Tensor] = {}
    for i in indices:
        p = f"_hstu._attention_layers.{i}."
        uvqk, o_w, o_b = take(p + "_uvqk"), take(p + "_o.weight"), take(p + "_o.bias")
        ts_w, pos_w = take(p + "_rel_attn_bias._ts_w"), take(p + "_rel_attn_bias._pos_w")
        if tuple(uvqk.shape) != (E, 4 * H * dv) or tuple(o_w.shape) != (E, H * dv) or tuple(o_b.shape) != (E,):
            raise UnsupportedCheckpoint(f"layer {i}: _uvqk {list(uvqk.shape)}, _o {list(o_w.shape)} do not match "
                                        f"layer 0 ([{E}, {4 * H * dv}], [{E}, {H * dv}])")
        if pos_w.shape != (2 * N - 1,):
            raise UnsupportedCheckpoint(f"layer {i}: _pos_w has {pos_w.shape[0]} entries; a sequence length of {N} "
                                        f"needs {2 * N - 1}")
        n_time = n_time or ts_w.shape[0]
        if ts_w.shape != (n_time,):
            raise UnsupportedCheckpoint(f"layer {i}: _ts_w has {ts_w.shape[0]} buckets, layer 0 has {n_time}")
        ours |= {
            f"layers.{i}.uvqk_weight": uvqk,  # the same [E, U|V|Q|K] layout, head-major within each
            f"layers.{i}.uvqk_bias": torch.zeros(4 * H * dv),  # the reference's projection has no bias
            f"layers.{i}.out_weight": o_w.t().contiguous(),  # nn.Linear's [out, in] → our [H·D, E]
            f"layers.{i}.out_bias": o_b,
            # the reference's bias of row i over key j is _pos_w[N − 1 + j − i]: distance d reads entry N − 1 − d
            f"layers.{i}.pos_bias": pos_w[:N].flip(0).expand(H, N).contiguous(),  # shared by every head
            f"layers.{i}.time_bias": ts_w.expand(H, n_time).contiguous(),
        }
    ours |= {
        "item_emb": items,
        "action_emb": torch.zeros(NUM_ACTIONS, E),
        # positions 0…N−1 as the reference's table; the candidates' own position (N) is never run here
        "pos_emb": torch.cat([positions, torch.zeros(1, E)]),
    }
    unused = sorted(set(state) - used)
    if unused:
        raise UnsupportedCheckpoint(f"{unused[0]}: not a parameter of the research HSTU this importer maps "
                                    f"({len(unused)} such in all)")
    config = ModelConfig(
        num_items=n_rows, num_actions=NUM_ACTIONS, embed_dim=E, num_layers=len(indices), num_heads=H, head_dim=dv,
        num_position_buckets=N, num_time_buckets=n_time, max_seq_len=N,
        attn_normaliser="constant", ln_eps=REFERENCE_EPS, attn_scale="one", position_buckets="exact",
        time_buckets="gr", query_time="next", bias_needs_timestamps=True, input_positions=True, min_item_id=1,
        scoring="last_position", output_norm="l2" if settings.user_embedding_norm == "l2_norm" else "layer",
        item_l2_norm=settings.item_l2_norm,
    )
    return config, ours


def _check_settings(s: ReferenceSettings) -> None:
    if s.num_heads < 1:
        raise UnsupportedCheckpoint(f"--num-heads must be at least 1, got {s.num_heads}")
    if s.normalization not in ("rel_bias", "hstu_rel_bias"):
        raise UnsupportedCheckpoint(f"normalization {s.normalization!r}: RelayGR's attention is pointwise SiLU "
                                    f"(the reference's rel_bias / hstu_rel_bias), not softmax")
    if s.linear_activation != "silu":
        raise UnsupportedCheckpoint(f"linear_activation {s.linear_activation!r}: RelayGR applies SiLU to U, V, Q, K "
                                    f"(the reference's 'silu')")
    if s.concat_ua:
        raise UnsupportedCheckpoint("concat_ua=True: the output projection reads [u, a, u·a]; RelayGR's reads u·a "
                                    "(concat_ua=False)")
    if s.user_embedding_norm not in ("l2_norm", "layer_norm"):
        raise UnsupportedCheckpoint(f"user_embedding_norm {s.user_embedding_norm!r}: the reference knows "
                                    f"l2_norm and layer_norm")


def import_checkpoint(checkpoint: str | Path, out: str | Path, settings: ReferenceSettings) -> HSTUModel:
    """Convert CHECKPOINT and write it as a RelayGR weights file; returns the model written. A
    ``train.py`` file name that contradicts the weights is refused."""
    try:
        raw = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UnsupportedCheckpoint(f"{checkpoint}: no such file") from None
    except Exception as exc:  # noqa: BLE001 — an unreadable file is one answer to the user
        raise UnsupportedCheckpoint(f"{checkpoint}: cannot be read as a torch checkpoint "
                                    f"({type(exc).__name__})") from None
    config, state = convert(reference_state_dict(raw), settings)
    named = NamedModel.of(checkpoint)
    if named is not None:
        named.check(config)
    model = HSTUModel.from_state_dict(config, state)
    model.save(out, source={"importer": "relay_engine.import_gr", "checkpoint": str(checkpoint),
                            "reference": "facebookresearch/generative-recommenders research HSTU",
                            **{k: str(v) for k, v in settings.__dict__.items()}})
    return model


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relay_engine.import_gr", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint of generative-recommenders' research HSTU (train.py's ckpts/…)")
    p.add_argument("--out", required=True, help="the RelayGR weights file to write (serve with RELAYGR_MODEL=FILE)")
    p.add_argument("--num-heads", type=int,
                   help="hstu_encoder.num_heads (default: from train.py's checkpoint name, HSTU-b…-h<H>-…)")
    p.add_argument("--user-embedding-norm", choices=("l2_norm", "layer_norm"), default="l2_norm",
                   help="train_fn.user_embedding_norm (default l2_norm)")
    p.add_argument("--item-l2-norm", action=argparse.BooleanOptionalAction,
                   help="train_fn.item_l2_norm (default: from the checkpoint name's '-l2-eps', else true)")
    p.add_argument("--normalization", default="rel_bias", help="hstu_encoder.normalization (default rel_bias)")
    p.add_argument("--linear-activation",
                   help="hstu_encoder.linear_activation (default: from the checkpoint name, else silu)")
    p.add_argument("--concat-ua", action="store_true", help="hstu_encoder.concat_ua was true (refused)")
    args = p.parse_args(argv)
    named = NamedModel.of(args.checkpoint)
    if named is not None and args.num_heads not in (None, named.num_heads):
        p.error(f"--num-heads {args.num_heads}, but the checkpoint's name says h{named.num_heads}")
    num_heads = args.num_heads or (named.num_heads if named else None)
    if num_heads is None:
        p.error("--num-heads is required: the checkpoint's name does not say it (train.py's HSTU-b…-h<H>-…)")
    settings = ReferenceSettings(
        num_heads, args.user_embedding_norm,
        args.item_l2_norm if args.item_l2_norm is not None else (named.item_l2_norm if named else True),
        args.normalization, args.linear_activation or (named.linear_activation if named else "silu"), args.concat_ua)
    try:
        model = import_checkpoint(args.checkpoint, args.out, settings)
    except UnsupportedCheckpoint as exc:
        print(f"cannot import: {exc}", file=sys.stderr)
        return 2
    c = model.config
    print(f"wrote {args.out}: model {model.version}, {c.num_layers} layers × {c.num_heads} heads × {c.head_dim}, "
          f"{c.num_items - 1} items (ids 1…{c.num_items - 1}), sequences up to {c.max_seq_len} tokens")
    print(f"serve it: RELAYGR_MODEL={args.out}")
    return 0
