"""The model's configuration: its dimensions, and the semantics options by which it can differ from
Meta's reference HSTU (``docs/model.md`` has the table), each checked when a ``ModelConfig`` is made."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from relay_engine.core.config import ModelFingerprint

# Allowed values of the semantics options, first = RelayGR's own (the default).
MODEL_OPTIONS: dict[str, tuple[str, ...]] = {
    "attn_normaliser": ("row", "constant"),
    "attn_scale": ("rsqrt_dim", "one"),
    "position_buckets": ("log", "exact"),
    "time_buckets": ("sqrt2", "gr"),
    "query_time": ("own", "next"),
    "scoring": ("candidate_tokens", "last_position"),
    "output_norm": ("layer", "l2"),
}


@dataclass(frozen=True)
class ModelConfig:
    num_items: int = 65_536
    num_actions: int = 8  # action 0 is reserved for candidates (their action is what we predict)
    embed_dim: int = 128
    num_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32  # per head, for Q/K and for V/U alike
    num_position_buckets: int = 64
    num_time_buckets: int = 64
    max_seq_len: int = 16_384  # history tokens (prefix + short-term) a request may carry
    # Rows (and keys) per tile of the causal attention, at most; the model caps it further for cache locality.
    block_rows: int = 512
    seed: int = 0
    # --- semantics (defaults: RelayGR's own; the reference HSTU's are in docs/model.md) ---
    attn_normaliser: str = "row"  # "row": row i / its key count; "constant": every row / max_seq_len
    ln_eps: float = 1e-5  # epsilon of every layer norm, and the floor of the L2 norms
    attn_scale: str = "rsqrt_dim"  # "rsqrt_dim": scores q·k/√head_dim; "one": q·k
    position_buckets: str = "log"  # "log": exact below half the buckets, log-spaced above; "exact": one per distance
    time_buckets: str = "sqrt2"  # "sqrt2": ⌊2·log2(Δt + 1)⌋, Δt < 0 → 0; "gr": ⌊ln(max(|Δt|, 1)) / 0.301⌋
    query_time: str = "own"  # a history row's time for the time bias: its own, or the next token's ("next")
    bias_needs_timestamps: bool = False  # True: tokens without timestamps get no relative bias at all
    input_positions: bool = False  # add a learned absolute position embedding to every input token
    min_item_id: int = 0  # item ids below this are refused (the reference's id 0 is padding)
    scoring: str = "candidate_tokens"  # or "last_position": the last history row's embedding · item embeddings
    output_norm: str = "layer"  # normalisation of the scoring row(s): "layer" or "l2"
    item_l2_norm: bool = False  # L2-normalise item embeddings before scoring

    def __post_init__(self) -> None:
        for name, allowed in MODEL_OPTIONS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("num_items", "num_actions", "embed_dim", "num_layers", "num_heads", "head_dim",
                     "num_position_buckets", "num_time_buckets", "max_seq_len", "block_rows"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if not 0 <= self.min_item_id < self.num_items:
            raise ValueError(f"min_item_id: must be in [0, num_items − 1 = {self.num_items - 1}], "
                             f"got {self.min_item_id}")
        if not 0 < self.ln_eps < 1:
            raise ValueError(f"ln_eps: must be in (0, 1), got {self.ln_eps!r}")

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(self.num_layers, self.num_heads, self.head_dim)

    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def carries_tail(self) -> bool:
        """Whether the prefix's last token is re-run with what follows it (``PrefixKV.tail``): its
        state depends on the next token's timestamp, or its output is the scoring row."""
        return self.query_time == "next" or self.scoring == "last_position"

    def version(self) -> str:
        """Identity of the weights: same config and seed → same weights → same version.

        The semantics options enter only when they differ from their defaults, so the versions of
        configurations that predate them (and the caches keyed by those) stay what they were.
        """
        defaults = {f.name: f.default for f in dataclasses.fields(self) if f.name in _SEMANTICS}
        items = [(k, v) for k, v in sorted(self.__dict__.items()) if k not in defaults or v != defaults[k]]
        return "hstu-" + hashlib.sha256(repr(items).encode()).hexdigest()[:12]

    def kv_bytes_per_token(self, with_timestamps: bool = False) -> int:
        """Bytes of prefix cache per token: K and V (float32) in every layer, plus its timestamp."""
        return self.num_layers * 2 * self.num_heads * self.head_dim * 4 + (8 if with_timestamps else 0)


_SEMANTICS = frozenset(("attn_normaliser", "ln_eps", "attn_scale", "position_buckets", "time_buckets",
                        "query_time", "bias_needs_timestamps", "input_positions", "min_item_id", "scoring",
                        "output_norm", "item_l2_norm"))
