"""An HSTU-style generative recommender with an explicit cached path for relay-race inference.

Following "Actions Speak Louder than Words" (Zhai et al., 2024): a sequence of (item, action)
tokens; per layer one fused projection gives U, V, Q, K through SiLU; attention is pointwise
(SiLU, no softmax) with relative position and, when timestamps are given, time-bucket biases,
normalised by a count that depends only on the query row; the layer output is
``W_o(Norm(A·V) ⊙ U)`` added to the residual stream.

Candidates are scored M-FALCON style by default: history tokens are causal; each candidate
attends to the whole history and to itself only, never to other candidates; all candidates share
the position just after the history. So the history's keys and values never depend on the
candidates, and the long-term prefix's per-layer K/V (``PrefixKV``) can be computed once by
``prefill`` and reused by ``rank`` — which gives the same scores as ``rank_full`` recomputing
everything.

The normaliser (``ModelConfig.attn_normaliser``) is per query row: its own key count (``"row"``:
``i + 1`` for history row i, ``L + 1`` for a candidate) or one constant, ``max_seq_len``
(``"constant"``, as Meta's reference HSTU divides by its configured length). Both are exact under
the prefix cache, because neither depends on how many tokens come after a row; only a normaliser
that did (the actual sequence length, say) would break it.

The other ``ModelConfig`` semantics options exist so that a checkpoint of the reference HSTU runs
here unchanged (``relay_engine.lab.gr_import``): its attention scale, exact position biases, time
buckets, the next token's timestamp as a row's query time, absolute input positions, and scoring
by the last position's embedding against item embeddings. When the state of the prefix's last
token depends on what follows it (query time "next", or scoring by the last position), the cache
keeps that one token as ``PrefixKV.tail`` and ``rank`` runs it again with the short-term tokens;
every other prefix token's K/V is final, so the cached path stays exact.

One function, ``forward``, serves all three operations (and training, probing and evaluation in
the lab), so the baseline and the cached path run the same kernels with the same batching of
candidates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from relay_engine.core.config import EDIT_SCOPES, EditingConfig, ModelFingerprint


class ModelInputError(ValueError):
    """Bad input to the model, naming the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class WeightsFileError(ValueError):
    """A weights file that cannot be served, naming the file and what is wrong with it."""

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


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


@dataclass
class History:
    """A run of user behaviour tokens. items/actions: [T] int64; timestamps: [T] int64 seconds or None."""

    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.items.shape[0])

    def __getitem__(self, index: slice) -> History:
        ts = None if self.timestamps is None else self.timestamps[index]
        return History(self.items[index], self.actions[index], ts)

    @classmethod
    def from_lists(cls, items: Sequence[int], actions: Sequence[int],
                   timestamps: Sequence[int] | None = None) -> History:
        return cls(
            torch.as_tensor(items, dtype=torch.int64),
            torch.as_tensor(actions, dtype=torch.int64),
            None if timestamps is None else torch.as_tensor(timestamps, dtype=torch.int64),
        )

    def concat(self, other: History) -> History:
        if (self.timestamps is None) != (other.timestamps is None):
            raise ModelInputError("timestamps", "prefix and short-term tokens must both have timestamps or neither")
        ts = None if self.timestamps is None else torch.cat([self.timestamps, other.timestamps])
        return History(torch.cat([self.items, other.items]), torch.cat([self.actions, other.actions]), ts)

    def to(self, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> History:
        def move(t: torch.Tensor) -> torch.Tensor:
            t = t.to(device, non_blocking=non_blocking)
            return t.pin_memory() if pin else t

        return History(move(self.items), move(self.actions), None if self.timestamps is None else move(self.timestamps))

    @property
    def nbytes(self) -> int:
        parts = (self.items, self.actions) + (() if self.timestamps is None else (self.timestamps,))
        return sum(t.numel() * t.element_size() for t in parts)

    def digest(self) -> str:
        """Content hash of the tokens: part of the cache key, so a changed prefix never hits."""
        h = hashlib.blake2b(digest_size=16)
        for t in (self.items, self.actions, self.timestamps):
            if t is None:
                h.update(b"-")
            else:
                h.update(t.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
        return h.hexdigest()


@dataclass
class PrefixKV:
    """Per-layer keys and values of a pre-inferred long-term prefix.

    kv: [num_layers, 2, H, T, D] (index 0 = K, 1 = V) of the prefix's first T = ``settled`` tokens;
    timestamps: [T] or None. ``tail``: the prefix's last token, kept as tokens rather than K/V when
    its state depends on what follows it (``ModelConfig.carries_tail``); ``rank`` runs it again.
    """

    kv: torch.Tensor
    timestamps: torch.Tensor | None
    length: int
    model_version: str
    edit_hash: str
    tail: History | None = None

    @property
    def settled(self) -> int:
        """Prefix tokens whose K/V this cache holds."""
        return self.length - (0 if self.tail is None else len(self.tail))

    @property
    def nbytes(self) -> int:
        ts = 0 if self.timestamps is None else self.timestamps.numel() * self.timestamps.element_size()
        tail = 0 if self.tail is None else self.tail.nbytes
        return self.kv.numel() * self.kv.element_size() + ts + tail

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def to(self, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> PrefixKV:
        kv = self.kv.to(device, non_blocking=non_blocking)
        ts = None if self.timestamps is None else self.timestamps.to(device, non_blocking=non_blocking)
        if pin:
            kv = kv.pin_memory()
            ts = None if ts is None else ts.pin_memory()
        tail = None if self.tail is None else self.tail.to(device, pin=pin, non_blocking=non_blocking)
        return PrefixKV(kv, ts, self.length, self.model_version, self.edit_hash, tail)


@dataclass(frozen=True)
class LowRankMap:
    """A low-rank edit in tensor form: on the outputs of ``heads`` (concatenated, h [rows, n·D]) it adds
    ``(h·down + down_bias)·up``, which is ``α·Rᵀ(W·h + b − R·h)`` with down = (W − R)ᵀ, down_bias = b, up = α·R."""

    heads: torch.Tensor  # [n] int64
    down: torch.Tensor  # [n·D, r]
    down_bias: torch.Tensor  # [r]
    up: torch.Tensor  # [r, n·D]

    @classmethod
    def from_parts(cls, heads: torch.Tensor, rotation: torch.Tensor, source_weight: torch.Tensor,
                   source_bias: torch.Tensor, alpha: float = 1.0) -> LowRankMap:
        """From R, W [r, n·D] and b [r]; differentiable in them (the lab fits them through this)."""
        return cls(heads, (source_weight - rotation).T, source_bias, alpha * rotation)

    def delta(self, heads: torch.Tensor) -> torch.Tensor:
        """The change to the edited heads' outputs: heads [rows, H, D] → [rows, n, D]."""
        rows, n, d = heads.shape[0], self.heads.numel(), heads.shape[2]
        h = heads.index_select(1, self.heads).reshape(rows, n * d)  # [rows, n·D]
        return (torch.addmm(self.down_bias, h, self.down) @ self.up).view(rows, n, d)


@dataclass(frozen=True)
class EditTensors:
    """An edit in tensor form, per layer: a [H, D] bias added to the head outputs (or None) and
    low-rank maps of them. Every edit of a layer reads the unedited outputs; their changes add."""

    bias_by_layer: tuple[torch.Tensor | None, ...]
    maps_by_layer: tuple[tuple[LowRankMap, ...], ...]
    scope: str = "candidates"
    content_hash: str = "none"

    @classmethod
    def none(cls, num_layers: int) -> EditTensors:
        return cls((None,) * num_layers, ((),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.bias_by_layer)

    def apply(self, layer: int, heads: torch.Tensor, first_candidate_row: int) -> torch.Tensor:
        """Layer ``layer``'s head outputs [rows, H, D] under this edit: every row for scope "all", the
        rows from ``first_candidate_row`` on for "candidates" (the others are returned untouched)."""
        bias, maps = self.bias_by_layer[layer], self.maps_by_layer[layer]
        start = 0 if self.scope == "all" else first_candidate_row
        if (bias is None and not maps) or start >= heads.shape[0]:
            return heads
        part = heads[start:]  # [rows', H, D]
        edited = part if bias is None else part + bias
        for m in maps:
            edited = edited.index_add(1, m.heads, m.delta(part))
        return edited if start == 0 else torch.cat([heads[:start], edited])


class HSTULayer(nn.Module):
    """One HSTU block's parameters (its computation is ``HSTUModel.forward``'s loop body)."""

    def __init__(self, c: ModelConfig, g: torch.Generator | None = None):
        super().__init__()

        def normal(*shape: int, std: float) -> nn.Parameter:
            return nn.Parameter(torch.randn(*shape, generator=g) * std, requires_grad=False)

        def zeros(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape), requires_grad=False)

        self.uvqk_weight = normal(c.embed_dim, 4 * c.attn_dim, std=1 / math.sqrt(c.embed_dim))  # [E, 4·H·D]
        self.uvqk_bias = zeros(4 * c.attn_dim)  # [4·H·D]
        self.out_weight = normal(c.attn_dim, c.embed_dim, std=1 / math.sqrt(c.attn_dim))  # [H·D, E]
        self.out_bias = zeros(c.embed_dim)  # [E]
        self.pos_bias = normal(c.num_heads, c.num_position_buckets, std=0.1)  # [H, num_position_buckets]
        self.time_bias = normal(c.num_heads, c.num_time_buckets, std=0.1)  # [H, num_time_buckets]


# What a weights file says it is (``HSTUModel.save`` writes it, ``read_weights`` checks it).
WEIGHTS_FORMAT = "relaygr-hstu-weights"
WEIGHTS_FORMAT_VERSION = 1


class HSTUModel(nn.Module):
    """The model's weights on one device and the three operations of relay-race inference.

    Parameters are created with ``requires_grad=False`` (serving never needs gradients); training
    code switches them on for its own run. The edit in force is never stored here: every operation
    takes the ``EditTensors`` it runs under (the engine owns the one in force).
    """

    def __init__(self, config: ModelConfig | None = None, device: torch.device | str = "cpu"):
        super().__init__()
        c = self.config = config or ModelConfig()
        g = torch.Generator().manual_seed(c.seed)
        self.layers = nn.ModuleList(HSTULayer(c, g) for _ in range(c.num_layers))
        self.item_emb = nn.Parameter(torch.randn(c.num_items, c.embed_dim, generator=g) * 0.5,
                                     requires_grad=False)  # [num_items, E]
        self.action_emb = nn.Parameter(torch.randn(c.num_actions, c.embed_dim, generator=g) * 0.5,
                                       requires_grad=False)  # [num_actions, E]
        # Absolute positions 0…max_seq_len: the history's tokens, then the one the candidates share.
        self.pos_emb = nn.Parameter(torch.randn(c.max_seq_len + 1, c.embed_dim, generator=g) * 0.1,
                                    requires_grad=False) if c.input_positions else None  # [max_seq_len + 1, E]
        self.register_buffer("pos_bucket_of_diff", _position_buckets(c), persistent=False)
        self.version = c.version()
        self.to(device)

    @property
    def device(self) -> torch.device:
        return self.item_emb.device

    # --- weights files -------------------------------------------------------------------------

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: Mapping[str, torch.Tensor],
                        device: torch.device | str = "cpu") -> HSTUModel:
        """A model with these weights (names and shapes as ``state_dict()`` has them). Raises
        ValueError naming the first parameter missing, unexpected, mis-shaped or not finite. Its
        ``version`` hashes the weights, so caches never mix two sets of them."""
        model = cls(config)
        own = model.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            what = f"missing parameter {missing[0]}" if missing else f"unexpected parameter {unexpected[0]}"
            raise ValueError(f"{what} ({len(missing)} missing, {len(unexpected)} unexpected in all)")
        for name, target in own.items():
            source = state[name]
            if not isinstance(source, torch.Tensor) or not source.is_floating_point():
                raise ValueError(f"{name}: must be a floating-point tensor")
            if tuple(source.shape) != tuple(target.shape):
                raise ValueError(f"{name}: has shape {list(source.shape)}, the config needs {list(target.shape)}")
            if not bool(torch.isfinite(source).all()):
                raise ValueError(f"{name}: has NaN or infinite values")
            with torch.no_grad():
                target.copy_(source)
        model.version = _weights_version(config, own)
        return model.to(device)

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str = "cpu") -> HSTUModel:
        """The model a weights file holds (``save``, ``python -m relay_engine.import_gr``), on device.
        Raises WeightsFileError naming the file and what is wrong with it."""
        config, state = read_weights(path)
        try:
            return cls.from_state_dict(config, state, device)
        except ValueError as exc:
            raise WeightsFileError(path, f"state_dict: {exc}") from None

    def save(self, path: str | Path, *, source: Mapping[str, object] | None = None) -> None:
        """Write the config and the weights (and where they came from) as one file for ``load``."""
        torch.save({"format": WEIGHTS_FORMAT, "format_version": WEIGHTS_FORMAT_VERSION,
                    "config": dataclasses.asdict(self.config),
                    "state_dict": {k: v.detach().to("cpu") for k, v in self.state_dict().items()},
                    "source": dict(source or {})}, path)

    # --- editing hook point ------------------------------------------------------------------

    def no_edit(self) -> EditTensors:
        return EditTensors.none(self.config.num_layers)

    def edit_from(self, editing: EditingConfig | None) -> EditTensors:
        """Turn an editing configuration into per-layer biases and low-rank maps, checking it fits this model."""
        c = self.config
        if editing is None or editing.is_empty:
            return self.no_edit()
        if editing.fingerprint != c.fingerprint():
            raise ModelInputError(
                "editing.fingerprint",
                f"targets {editing.fingerprint}, but this model is {c.fingerprint()}",
            )
        if editing.scope not in EDIT_SCOPES:
            raise ModelInputError("editing.scope", f"must be one of {EDIT_SCOPES}")
        if editing.scope == "candidates" and c.scoring != "candidate_tokens":
            raise ModelInputError("editing.scope", "this model scores by its last position and runs no candidate "
                                                   "tokens; use 'all'")
        bias_by_layer: list[torch.Tensor | None] = [None] * c.num_layers
        for e in editing.edits:
            if bias_by_layer[e.layer] is None:
                bias_by_layer[e.layer] = torch.zeros(c.num_heads, c.head_dim, device=self.device)
            bias_by_layer[e.layer][e.head] += e.alpha * torch.tensor(e.direction, dtype=torch.float32,
                                                                     device=self.device)
        maps_by_layer: list[list[LowRankMap]] = [[] for _ in range(c.num_layers)]

        def tensor(values: tuple) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=self.device)

        for m in editing.lowrank:
            maps_by_layer[m.layer].append(LowRankMap.from_parts(
                torch.tensor(m.heads, dtype=torch.int64, device=self.device), tensor(m.rotation),
                tensor(m.source_weight), tensor(m.source_bias), m.alpha))
        return EditTensors(tuple(bias_by_layer), tuple(tuple(maps) for maps in maps_by_layer), editing.scope,
                           editing.content_hash())

    def _edit_or_none(self, edit: EditTensors | None) -> EditTensors:
        if edit is None:
            return self.no_edit()
        if edit.num_layers != self.config.num_layers:
            raise ModelInputError("edit", f"has {edit.num_layers} layers, model has {self.config.num_layers}")
        return edit

    # --- the three operations ----------------------------------------------------------------

    def prefix_nbytes(self, seq_len: int, with_timestamps: bool) -> int:
        """Exact size of the PrefixKV that ``prefill`` returns for seq_len tokens."""
        tail = 1 if self.config.carries_tail else 0
        tail_bytes = tail * 8 * (3 if with_timestamps else 2)  # items, actions (and timestamps), int64
        return (seq_len - tail) * self.config.kv_bytes_per_token(with_timestamps) + tail_bytes

    @torch.no_grad()
    def prefill(self, prefix: History, edit: EditTensors | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV:
        """Pre-infer a long-term prefix: its per-layer K/V, ready for ``rank``, under ``edit`` (none by default).
        ``between_layers`` is called before every layer but the first (where pre-inference yields to ranking)."""
        edit = self._edit_or_none(edit)
        self.check_history(prefix, "prefix", allow_empty=False)
        prefix = prefix.to(self.device)
        settled = len(prefix) - (1 if self.config.carries_tail else 0)
        if settled:
            # With query time "next" the last settled row queries at the tail's timestamp.
            next_ts = None if prefix.timestamps is None or settled == len(prefix) else int(prefix.timestamps[settled])
            kv, _ = self._forward(None, prefix[:settled], None, next_ts, edit, between_layers=between_layers)
        else:
            c = self.config
            kv = torch.empty(c.num_layers, 2, c.num_heads, 0, c.head_dim, device=self.device)
        return self._prefix_kv(prefix, kv, edit)

    @torch.no_grad()
    def rank(self, prefix_kv: PrefixKV, short_term: History, candidates: Sequence[int] | torch.Tensor,
             query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        """Score candidates against a cached prefix plus fresh short-term tokens. Returns [C] scores."""
        edit = self._edit_or_none(edit)
        if prefix_kv.model_version != self.version:
            raise ModelInputError("prefix_kv", f"was computed by model {prefix_kv.model_version}, not {self.version}")
        if prefix_kv.edit_hash != edit.content_hash:
            raise ModelInputError("prefix_kv", f"was computed under edit {prefix_kv.edit_hash}, "
                                               f"the edit in force is {edit.content_hash}")
        if prefix_kv.device != self.device:
            raise ModelInputError("prefix_kv", f"is on {prefix_kv.device}, the model on {self.device}")
        self.check_history(short_term, "short_term", allow_empty=True)
        if (prefix_kv.timestamps is None) != (short_term.timestamps is None):
            raise ModelInputError("short_term.timestamps", "must be given exactly when the prefix had timestamps")
        if prefix_kv.length + len(short_term) > self.config.max_seq_len:
            raise ModelInputError("short_term", f"prefix + short-term is {prefix_kv.length + len(short_term)} "
                                                f"tokens; the model takes at most {self.config.max_seq_len}")
        cands = self.check_candidates(candidates)
        _, scores = self._forward(prefix_kv, short_term.to(self.device), cands, query_timestamp, edit)
        return scores

    @torch.no_grad()
    def rank_full(self, prefix: History, short_term: History, candidates: Sequence[int] | torch.Tensor,
                  query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor:
        """The baseline: recompute the whole history and the candidates. Returns [C] scores."""
        scores, _ = self._rank_full(prefix, short_term, candidates, query_timestamp, edit, keep_prefix=False)
        return scores

    @torch.no_grad()
    def rank_full_keeping_prefix(self, prefix: History, short_term: History,
                                 candidates: Sequence[int] | torch.Tensor, query_timestamp: int | None = None,
                                 edit: EditTensors | None = None) -> tuple[torch.Tensor, PrefixKV]:
        """``rank_full`` that also returns the prefix's KV, which its history pass computes anyway:
        a cache miss then costs one forward, not a prefill followed by a cached rank."""
        scores, kv = self._rank_full(prefix, short_term, candidates, query_timestamp, edit, keep_prefix=True)
        assert kv is not None
        return scores, kv

    def _rank_full(self, prefix: History, short_term: History, candidates: Sequence[int] | torch.Tensor,
                   query_timestamp: int | None, edit: EditTensors | None, *,
                   keep_prefix: bool) -> tuple[torch.Tensor, PrefixKV | None]:
        edit = self._edit_or_none(edit)
        self.check_history(prefix, "prefix", allow_empty=not keep_prefix)
        self.check_history(short_term, "short_term", allow_empty=True)
        history = prefix.concat(short_term)
        if len(history) == 0:
            raise ModelInputError("prefix", "prefix and short-term tokens are both empty; need at least one token")
        cands = self.check_candidates(candidates)
        history = history.to(self.device)
        kv, scores = self._forward(None, history, cands, query_timestamp, edit)
        if not keep_prefix:
            return scores, None
        return scores, self._prefix_kv(history[:len(prefix)], kv, edit)

    def _prefix_kv(self, prefix: History, kv: torch.Tensor, edit: EditTensors) -> PrefixKV:
        """The cache of a prefix, from the K/V of a history that starts with it (kv: [layers, 2, H, ≥T, D])."""
        settled = len(prefix) - (1 if self.config.carries_tail else 0)
        if kv.shape[3] != settled:
            kv = kv[:, :, :, :settled].contiguous()
        ts = None if prefix.timestamps is None else prefix.timestamps[:settled]
        # The tail is copied out, so the cache never keeps the caller's whole token tensors alive.
        tail = prefix[settled:].to(self.device) if self.config.carries_tail else None
        if tail is not None:
            tail = History(tail.items.clone(), tail.actions.clone(),
                           None if tail.timestamps is None else tail.timestamps.clone())
        return PrefixKV(kv, ts, len(prefix), self.version, edit.content_hash, tail)

    # --- input checks ------------------------------------------------------------------------

    def check_history(self, h: History, name: str, *, allow_empty: bool) -> None:
        c = self.config
        for part in ("items", "actions") + (("timestamps",) if h.timestamps is not None else ()):
            t = getattr(h, part)
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
                raise ModelInputError(f"{name}.{part}", "must be a 1-D int64 tensor")
            if t.shape[0] != len(h):
                raise ModelInputError(f"{name}.{part}", f"has {t.shape[0]} entries, items has {len(h)}")
        if not allow_empty and len(h) == 0:
            raise ModelInputError(name, "is empty; need at least one token")
        if len(h) > c.max_seq_len:
            raise ModelInputError(name, f"has {len(h)} tokens; the model takes at most {c.max_seq_len}")
        if len(h):
            _check_range(h.items, f"{name}.items", c.min_item_id, c.num_items - 1)
            _check_range(h.actions, f"{name}.actions", 0, c.num_actions - 1)
            if h.timestamps is not None:
                _check_range(h.timestamps, f"{name}.timestamps", 0, 2**62)

    def check_candidates(self, candidates: Sequence[int] | torch.Tensor) -> torch.Tensor:
        try:
            cands = torch.as_tensor(candidates)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ModelInputError("candidates", f"must be a list of item ids ({exc})") from None
        if cands.numel() == 0:
            raise ModelInputError("candidates", "is empty; need at least one candidate")
        if cands.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or cands.dim() != 1:
            raise ModelInputError("candidates", f"must be a 1-D list of integer item ids, got {cands.dtype} "
                                                f"with {cands.dim()} dims")
        _check_range(cands, "candidates", self.config.min_item_id, self.config.num_items - 1)
        return cands.to(self.device, torch.int64)

    # --- the shared forward ------------------------------------------------------------------

    def embed(self, items: torch.Tensor, actions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, E] of tokens at absolute ``positions`` [T] (counted from the start of
        the history; they matter only with ``ModelConfig.input_positions``)."""
        x = (self.item_emb[items] + self.action_emb[actions]) * math.sqrt(self.config.embed_dim)  # [T, E]
        return x if self.pos_emb is None else x + self.pos_emb[positions]

    def forward(self, history: History, candidates: torch.Tensor | None = None, *,
                prefix_kv: PrefixKV | None = None, query_timestamp: int | None = None,
                edit: EditTensors | None = None,
                head_capture: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one forward behind every operation, for training, probing and evaluation.

        Runs ``history`` (after ``prefix_kv`` when given, and after its tail token, which runs
        again) and the optional ``candidates`` [C] under ``edit``; returns (K/V of the tokens run
        [layers, 2, H, T, D], scores [C] or None). Gradients flow when the caller enables them.
        Inputs are moved to the model's device but not checked: the serving entry points
        (``prefill``, ``rank``, ``rank_full``) check them. ``head_capture``, when given, receives
        per layer the head outputs [rows, H, D] after the edit.
        """
        cands = None if candidates is None else torch.as_tensor(candidates).to(self.device, torch.int64)
        return self._forward(prefix_kv, history.to(self.device), cands, query_timestamp,
                             self._edit_or_none(edit), head_capture)

    def _forward(self, cached: PrefixKV | None, history: History, candidates: torch.Tensor | None,
                 query_timestamp: int | None, edit: EditTensors, head_capture: list[torch.Tensor] | None = None,
                 between_layers: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new history tokens (after an optional cached prefix) and optional candidates.

        Returns (kv of the history tokens run [layers, 2, H, Tn, D], candidate scores [C] or None).
        ``query_timestamp`` is when the ranking happens (default: the last history token's time).
        ``head_capture``, when given, receives per layer the head outputs [rows, H, D] after the
        edit (the probing point of the editing workflow).
        """
        c = self.config
        H, D, E = c.num_heads, c.head_dim, c.embed_dim
        if cached is not None and cached.tail is not None:
            history = cached.tail.concat(history)  # the prefix's last token runs again, with what follows it
        Tp = cached.settled if cached is not None else 0
        Tn = len(history)
        C = 0 if candidates is None else int(candidates.shape[0])
        cand_rows = C if c.scoring == "candidate_tokens" else 0  # candidates that run as tokens
        L = Tp + Tn  # history length; candidate tokens sit at position L
        if C and not cand_rows and not Tn:
            raise ModelInputError("history", "is empty; scoring by the last position needs at least one token")

        ts_hist = history.timestamps  # [Tn]: the keys' times
        ts_prefix = cached.timestamps if cached is not None else None
        use_time = ts_hist is not None or ts_prefix is not None
        ts_cand = ts_query = None
        if use_time:
            if query_timestamp is None:
                last = ts_hist[-1] if Tn else ts_prefix[-1]
                query_timestamp = int(last)
            ts_cand = torch.full((1,), int(query_timestamp), dtype=torch.int64, device=self.device)  # [1]
            # The time each history row queries at: its own, or the next token's (the last row: the query's).
            ts_query = ts_hist if c.query_time == "own" else torch.cat([ts_hist, ts_cand])[1:]  # [Tn]
        use_pos = use_time or not c.bias_needs_timestamps

        x = self.embed(history.items, history.actions, torch.arange(Tp, L, device=self.device))  # [Tn, E]
        if cand_rows:
            cand_pos = torch.full((C,), L, dtype=torch.int64, device=self.device)
            x = torch.cat([x, self.embed(candidates, torch.zeros_like(candidates), cand_pos)])  # [Tn + C, E]
        rows = Tn + cand_rows
        is_candidate = torch.arange(rows, device=self.device) >= Tn  # [rows]
        if c.attn_normaliser == "row":
            # Keys each query row sees: history row at position p → p + 1; candidate → L + 1.
            n_keys = torch.where(is_candidate, torch.full((rows,), float(L + 1), device=self.device),
                                 torch.arange(Tp + 1, Tp + rows + 1, device=self.device, dtype=torch.float32))
        else:
            n_keys = torch.full((rows,), float(c.max_seq_len), device=self.device)

        new_kv = torch.empty(c.num_layers, 2, H, Tn, D, device=self.device)
        scale = 1.0 / math.sqrt(D) if c.attn_scale == "rsqrt_dim" else 1.0
        kp = cached.kv[:, 0] if cached is not None else None  # [layers, H, Tp, D]
        vp = cached.kv[:, 1] if cached is not None else None
        for li, layer in enumerate(self.layers):
            if li and between_layers is not None:
                between_layers()
            normed = F.layer_norm(x, (E,), eps=c.ln_eps)
            uvqk = F.silu(torch.addmm(layer.uvqk_bias, normed, layer.uvqk_weight))  # [rows, 4·H·D]
            u, v, q, k = (t.reshape(rows, H, D).transpose(0, 1) for t in uvqk.split(c.attn_dim, dim=1))
            # v, q, k: [H, rows, D], contiguous; the score scale is folded into q once
            q, k, v = q * scale, k.contiguous(), v.contiguous()
            new_kv[li, 0] = k[:, :Tn]
            new_kv[li, 1] = v[:, :Tn]
            parts = []  # A·V, before normalisation, of the history rows then the candidate rows
            if Tn:
                hist = self._attend_causal(layer, q[:, :Tn], k[:, :Tn], v[:, :Tn], ts_query, ts_hist, use_pos)
                if Tp:
                    hist += self._attend_visible(layer, q[:, :Tn], Tp, ts_query, kp[li], vp[li], ts_prefix, use_pos)
                parts.append(hist)  # [H, Tn, D]
            if cand_rows:
                qc = q[:, Tn:]  # [H, C, D]
                cand = torch.zeros(H, C, D, device=self.device)  # every history key, ...
                if Tp:
                    cand += self._attend_visible(layer, qc, L, ts_cand, kp[li], vp[li], ts_prefix, use_pos,
                                                 one_position=True)
                if Tn:
                    cand += self._attend_visible(layer, qc, L - Tp, ts_cand, k[:, :Tn], v[:, :Tn], ts_hist, use_pos,
                                                 one_position=True)
                # ... and itself: distance 0, time difference 0 (bucket 0 under every bucket function)
                s_self = (qc * k[:, Tn:]).sum(-1)  # [H, C]
                if use_pos:
                    s_self = s_self + layer.pos_bias[:, self.pos_bucket_of_diff[0], None]
                if use_time:
                    s_self = s_self + layer.time_bias[:, 0:1]
                parts.append(cand + F.silu(s_self)[..., None] * v[:, Tn:])
            attn = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)) / n_keys[None, :, None]
            y = F.layer_norm(attn.transpose(0, 1).reshape(rows, c.attn_dim), (c.attn_dim,), eps=c.ln_eps)
            heads = (y * u.transpose(0, 1).reshape(rows, c.attn_dim)).reshape(rows, H, D)  # [rows, H, D]
            heads = edit.apply(li, heads, first_candidate_row=Tn)
            if head_capture is not None:
                head_capture.append(heads)
            x = x + torch.addmm(layer.out_bias, heads.reshape(rows, c.attn_dim), layer.out_weight)

        scores = None
        if cand_rows:
            scores = (self._output_norm(x[Tn:]) * self._item_vectors(candidates)).sum(-1) / math.sqrt(E)  # [C]
        elif C:
            scores = self._item_vectors(candidates) @ self._output_norm(x[Tn - 1])  # [C, E] @ [E] → [C]
        return new_kv, scores

    def _output_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The scoring rows [..., E], normalised as ``ModelConfig.output_norm`` says."""
        if self.config.output_norm == "layer":
            return F.layer_norm(h, (self.config.embed_dim,), eps=self.config.ln_eps)
        return h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp(min=self.config.ln_eps)

    def _item_vectors(self, items: torch.Tensor) -> torch.Tensor:
        """[C, E]: the embeddings candidates are scored against (L2-normalised with ``item_l2_norm``)."""
        e = self.item_emb[items]
        if self.config.item_l2_norm:
            e = e / torch.linalg.vector_norm(e, dim=-1, keepdim=True).clamp(min=self.config.ln_eps)
        return e

    def _attend_causal(self, layer: HSTULayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       ts_q: torch.Tensor | None, ts_k: torch.Tensor | None, use_pos: bool) -> torch.Tensor:
        """Un-normalised causal A·V of a run of tokens over its own keys: row i gets Σ_{j≤i} silu(s_ij)·v_j.

        q (pre-scaled), k, v: [H, T, D] → [H, T, D]; ts_q, ts_k: [T] query and key times, or None.
        Rows and keys are cut into b×b tiles. The position bias of a tile pair depends only on how
        many tiles apart they are, so every pair on one block diagonal shares one bias tile and they
        run as one batched matmul; tiles above the diagonal are never computed, and only the
        diagonal tiles need the causal mask.
        """
        H, T, D = q.shape
        n_tiles = -(-T // min(self.config.block_rows, _CAUSAL_TILE_ROWS))
        b = -(-T // n_tiles)  # the tile size that needs the least padding
        pad = n_tiles * b - T
        if pad:  # zero rows/keys at the end: their rows are dropped, their keys masked (after every row)
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            ts_q, ts_k = (None if t is None else F.pad(t, (0, pad)) for t in (ts_q, ts_k))
        # [tiles, H, b, D]: a run of consecutive tiles is one contiguous batch of (tile, head) matrices
        q_t, k_t, v_t = (t.reshape(H, n_tiles, b, D).transpose(0, 1).contiguous() for t in (q, k, v))
        tq_t, tk_t = (None if t is None else t.reshape(n_tiles, b) for t in (ts_q, ts_k))
        causal = torch.ones(b, b, dtype=torch.bool, device=self.device).tril_()
        pairs_per_step = max(1, _SCORE_TILE_ELEMS // (H * b * b))
        acc = torch.zeros(n_tiles, H, b, D, device=self.device)
        for d in range(n_tiles):  # row tile i against key tile i − d
            pos = self._pos_bias_tile(layer, d * b, b, b) if use_pos else None  # [H, b, b]
            for i0 in range(d, n_tiles, pairs_per_step):
                i1 = min(n_tiles, i0 + pairs_per_step)
                m = i1 - i0
                s = torch.matmul(q_t[i0:i1], k_t[i0 - d:i1 - d].transpose(-1, -2))  # [m, H, b, b]
                if pos is not None:
                    s.add_(pos)
                if tq_t is not None:
                    dt = tq_t[i0:i1, :, None] - tk_t[i0 - d:i1 - d, None, :]  # [m, b, b]
                    s.add_(self._time_bias(layer, dt).transpose(0, 1))
                F.silu(s, inplace=True)
                if d == 0:
                    s.mul_(causal)
                acc[i0:i1].view(m * H, b, D).baddbmm_(s.view(m * H, b, b), v_t[i0 - d:i1 - d].view(m * H, b, D))
        return acc.transpose(0, 1).reshape(H, n_tiles * b, D)[:, :T]

    def _attend_visible(self, layer: HSTULayer, q: torch.Tensor, first_diff: int, ts_q: torch.Tensor | None,
                        k: torch.Tensor, v: torch.Tensor, ts_k: torch.Tensor | None, use_pos: bool, *,
                        one_position: bool = False) -> torch.Tensor:
        """Un-normalised A·V of rows over keys that every row sees whole.

        q (pre-scaled): [H, n, D]; k, v: [H, T, D] → [H, n, D]. Row i and key j are first_diff + i − j
        positions apart, or first_diff − j for every row when ``one_position`` (the candidates: one
        position and one timestamp, ts_q [1], so their bias is one row, broadcast). Keys are taken in
        chunks so the [H, n, chunk] scores stay cache-sized.
        """
        H, n, D = q.shape
        bias_rows = 1 if one_position else n
        T = k.shape[1]
        out = torch.zeros(H, n, D, device=self.device)
        chunk = max(1, _SCORE_TILE_ELEMS // (H * n))
        for j0 in range(0, T, chunk):
            j1 = min(T, j0 + chunk)
            bias = self._pos_bias_tile(layer, first_diff - j0, bias_rows, j1 - j0) if use_pos else None  # [H, n|1, w]
            if ts_q is not None and ts_k is not None:
                time = self._time_bias(layer, ts_q[:, None] - ts_k[None, j0:j1])  # [H, n|1, w]
                bias = time if bias is None else bias + time
            k_t = k[:, j0:j1].transpose(1, 2)  # [H, D, w]
            s = torch.bmm(q, k_t) if bias is None else torch.baddbmm(bias.expand(H, n, j1 - j0), q, k_t)
            out.baddbmm_(F.silu(s, inplace=True), v[:, j0:j1])
        return out

    def _pos_bias_tile(self, layer: HSTULayer, first_diff: int, n_rows: int, n_keys: int) -> torch.Tensor:
        """[H, n_rows, n_keys]: the position bias of row i against key j, first_diff + i − j positions
        apart (negative differences, masked pairs, read difference 0). A Toeplitz matrix, so it is
        one strided copy of a short vector rather than a gather per element."""
        table = self.pos_bucket_of_diff
        diffs = torch.arange(first_diff - n_keys + 1, first_diff + n_rows, device=self.device)
        w = layer.pos_bias.index_select(1, table[diffs.clamp_(0, table.numel() - 1)])  # [H, n_rows + n_keys − 1]
        # hankel[h, i, j'] = w[h, i + j']; with j' = n_keys − 1 − j that is the bias at first_diff + i − j
        return w.as_strided((w.shape[0], n_rows, n_keys), (w.stride(0), 1, 1)).flip(-1)

    def _time_bias(self, layer: HSTULayer, dt: torch.Tensor) -> torch.Tensor:
        """[H, *dt.shape]: the time bias of each time difference (s) between a query and a key."""
        buckets = _time_buckets(dt, self.config.num_time_buckets, self.config.time_buckets)
        return layer.time_bias.index_select(1, buckets.reshape(-1)).view(-1, *dt.shape)


# Scores computed per step, at most: keeps the [H, rows, keys] tiles near the cache (4 MiB of float32).
_SCORE_TILE_ELEMS = 1 << 20
# Rows (and keys) per tile of the causal part; ``ModelConfig.block_rows`` may ask for fewer.
_CAUSAL_TILE_ROWS = 128


def read_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of a weights file written by ``HSTUModel.save``; WeightsFileError naming
    the file and the problem otherwise. Loads tensors only (``weights_only``): no code runs."""
    path = Path(path)
    if not path.is_file():
        raise WeightsFileError(path, "no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 — any unreadable file is the same answer to the user
        raise WeightsFileError(path, f"not a RelayGR weights file ({type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200] if str(exc) else 'unreadable'})") from None
    if not isinstance(blob, dict) or blob.get("format") != WEIGHTS_FORMAT:
        raise WeightsFileError(path, "not a RelayGR weights file (write one with `python -m relay_engine.import_gr`)")
    if blob.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise WeightsFileError(path, f"format version {blob.get('format_version')!r}; this build reads "
                                     f"{WEIGHTS_FORMAT_VERSION}")
    config, state = blob.get("config"), blob.get("state_dict")
    if not isinstance(config, dict) or not isinstance(state, dict):
        raise WeightsFileError(path, "has no config or no state_dict")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise WeightsFileError(path, f"config: unknown field {unknown[0]!r} (written by a newer RelayGR?)")
    try:
        return ModelConfig(**config), state
    except (TypeError, ValueError) as exc:
        raise WeightsFileError(path, f"config.{exc}") from None


def _weights_version(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> str:
    """A version that hashes the weights themselves, for weights not derived from a seed."""
    h = hashlib.sha256(config.version().encode())
    for name in sorted(state):
        t = state[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return "hstu-w" + h.hexdigest()[:12]


def _position_buckets(c: ModelConfig) -> torch.Tensor:
    """Bucket of each position difference 0…max_seq_len + 1: one per difference ("exact", the last
    bucket taking the rest), or exact below half the buckets and log-spaced above ("log")."""
    d = torch.arange(c.max_seq_len + 2, dtype=torch.float64)
    if c.position_buckets == "exact":
        return d.clamp(max=c.num_position_buckets - 1).long()
    exact = c.num_position_buckets // 2
    log_part = exact + torch.log(d.clamp(min=exact) / exact) / math.log(max(c.max_seq_len, exact + 1) / exact) \
        * (c.num_position_buckets - exact - 1)
    return torch.where(d < exact, d, log_part.floor()).clamp(max=c.num_position_buckets - 1).long()


def _time_buckets(dt: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """Bucket of a time difference (s). "sqrt2": log2-spaced twice per octave, negative differences
    in bucket 0; "gr": ⌊ln(max(|Δt|, 1)) / 0.301⌋ in float32, as the reference HSTU buckets."""
    if kind == "gr":
        return (torch.log(dt.abs().clamp_(min=1).float()) / 0.301).long().clamp_(0, n - 1)
    return torch.log2(dt.clamp(min=0).float() + 1.0).mul_(2.0).long().clamp_(0, n - 1)


def _check_range(t: torch.Tensor, name: str, lo: int, hi: int) -> None:
    t_min, t_max = int(t.min()), int(t.max())
    if t_min < lo or t_max > hi:
        bad = t_min if t_min < lo else t_max
        raise ModelInputError(name, f"value {bad} out of range [{lo}, {hi}]")
