"""An HSTU-style generative recommender with an explicit cached path for relay-race inference.

Following "Actions Speak Louder than Words" (Zhai et al., 2024): a sequence of (item, action)
tokens; per layer one fused projection gives U, V, Q, K through SiLU; attention is pointwise
(SiLU, no softmax) with relative position and, when timestamps are given, time-bucket biases,
normalised by the number of keys each query sees; the layer output is ``W_o(Norm(A·V) ⊙ U)``
added to the residual stream.

Candidates are scored M-FALCON style: history tokens are causal; each candidate attends to the
whole history and to itself only, never to other candidates; all candidates share the position
just after the history. So the history's keys and values never depend on the candidates, and the
long-term prefix's per-layer K/V (``PrefixKV``) can be computed once by ``prefill`` and reused by
``rank`` — which gives the same scores as ``rank_full`` recomputing everything.

Normalisation is per query row by its own key count (``i + 1`` for history row i, ``L + 1`` for a
candidate). A length-wide normaliser would make the prefix's deeper-layer K/V depend on how many
tokens come after it, and no prefix cache could then be exact.

One function, ``forward``, serves all three operations (and training, probing and evaluation in
the lab), so the baseline and the cached path run the same kernels with the same batching of
candidates.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from relay_engine.core.config import EDIT_SCOPES, EditingConfig, ModelFingerprint


class ModelInputError(ValueError):
    """Bad input to the model, naming the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


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

    def fingerprint(self) -> ModelFingerprint:
        return ModelFingerprint(self.num_layers, self.num_heads, self.head_dim)

    @property
    def attn_dim(self) -> int:
        return self.num_heads * self.head_dim

    def version(self) -> str:
        """Identity of the weights: same config and seed → same weights → same version."""
        text = repr(sorted(self.__dict__.items()))
        return "hstu-" + hashlib.sha256(text.encode()).hexdigest()[:12]

    def kv_bytes_per_token(self, with_timestamps: bool = False) -> int:
        """Bytes of prefix cache per token: K and V (float32) in every layer, plus its timestamp."""
        return self.num_layers * 2 * self.num_heads * self.head_dim * 4 + (8 if with_timestamps else 0)


@dataclass
class History:
    """A run of user behaviour tokens. items/actions: [T] int64; timestamps: [T] int64 seconds or None."""

    items: torch.Tensor
    actions: torch.Tensor
    timestamps: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.items.shape[0])

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

    kv: [num_layers, 2, H, T, D] (index 0 = K, 1 = V); timestamps: [T] or None.
    """

    kv: torch.Tensor
    timestamps: torch.Tensor | None
    length: int
    model_version: str
    edit_hash: str

    @property
    def nbytes(self) -> int:
        ts = 0 if self.timestamps is None else self.timestamps.numel() * self.timestamps.element_size()
        return self.kv.numel() * self.kv.element_size() + ts

    @property
    def device(self) -> torch.device:
        return self.kv.device

    def to(self, device: torch.device, *, pin: bool = False, non_blocking: bool = False) -> PrefixKV:
        kv = self.kv.to(device, non_blocking=non_blocking)
        ts = None if self.timestamps is None else self.timestamps.to(device, non_blocking=non_blocking)
        if pin:
            kv = kv.pin_memory()
            ts = None if ts is None else ts.pin_memory()
        return PrefixKV(kv, ts, self.length, self.model_version, self.edit_hash)


@dataclass(frozen=True)
class HeadBias:
    """Edits in tensor form: per layer a [H, D] bias added to the head outputs, or None."""

    by_layer: tuple[torch.Tensor | None, ...]
    scope: str = "all"
    content_hash: str = "none"

    @classmethod
    def none(cls, num_layers: int) -> HeadBias:
        return cls((None,) * num_layers)


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


class HSTUModel(nn.Module):
    """The model's weights on one device and the three operations of relay-race inference.

    Parameters are created with ``requires_grad=False`` (serving never needs gradients); training
    code switches them on for its own run. The edit in force is never stored here: every operation
    takes the ``HeadBias`` it runs under (the engine owns the one in force).
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
        self.register_buffer("pos_bucket_of_diff", _position_buckets(c), persistent=False)
        self.version = c.version()
        self.to(device)

    @property
    def device(self) -> torch.device:
        return self.item_emb.device

    # --- editing hook point ------------------------------------------------------------------

    def no_edit(self) -> HeadBias:
        return HeadBias.none(self.config.num_layers)

    def edit_from(self, editing: EditingConfig | None) -> HeadBias:
        """Turn an editing configuration into per-layer [H, D] biases, checking it fits this model."""
        c = self.config
        if editing is None or not editing.edits:
            return self.no_edit()
        if editing.fingerprint != c.fingerprint():
            raise ModelInputError(
                "editing.fingerprint",
                f"targets {editing.fingerprint}, but this model is {c.fingerprint()}",
            )
        if editing.scope not in EDIT_SCOPES:
            raise ModelInputError("editing.scope", f"must be one of {EDIT_SCOPES}")
        by_layer: list[torch.Tensor | None] = [None] * c.num_layers
        for e in editing.edits:
            if by_layer[e.layer] is None:
                by_layer[e.layer] = torch.zeros(c.num_heads, c.head_dim, device=self.device)
            by_layer[e.layer][e.head] += e.alpha * torch.tensor(e.direction, dtype=torch.float32,
                                                                device=self.device)
        return HeadBias(tuple(by_layer), editing.scope, editing.content_hash())

    def _edit_or_none(self, edit: HeadBias | None) -> HeadBias:
        if edit is None:
            return self.no_edit()
        if len(edit.by_layer) != self.config.num_layers:
            raise ModelInputError("edit", f"has {len(edit.by_layer)} layers, model has {self.config.num_layers}")
        return edit

    # --- the three operations ----------------------------------------------------------------

    def prefix_nbytes(self, seq_len: int, with_timestamps: bool) -> int:
        """Exact size of the PrefixKV that ``prefill`` returns for seq_len tokens."""
        return seq_len * self.config.kv_bytes_per_token(with_timestamps)

    @torch.no_grad()
    def prefill(self, prefix: History, edit: HeadBias | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV:
        """Pre-infer a long-term prefix: its per-layer K/V, ready for ``rank``, under ``edit`` (none by default).
        ``between_layers`` is called before every layer but the first (where pre-inference yields to ranking)."""
        edit = self._edit_or_none(edit)
        self.check_history(prefix, "prefix", allow_empty=False)
        prefix = self._to_device(prefix)
        kv, _ = self._forward(None, prefix, None, None, edit, between_layers=between_layers)
        return PrefixKV(kv, prefix.timestamps, len(prefix), self.version, edit.content_hash)

    @torch.no_grad()
    def rank(self, prefix_kv: PrefixKV, short_term: History, candidates: Sequence[int] | torch.Tensor,
             query_timestamp: int | None = None, edit: HeadBias | None = None) -> torch.Tensor:
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
        _, scores = self._forward(prefix_kv, self._to_device(short_term), cands, query_timestamp, edit)
        return scores

    @torch.no_grad()
    def rank_full(self, prefix: History, short_term: History, candidates: Sequence[int] | torch.Tensor,
                  query_timestamp: int | None = None, edit: HeadBias | None = None) -> torch.Tensor:
        """The baseline: recompute the whole history and the candidates. Returns [C] scores."""
        scores, _ = self._rank_full(prefix, short_term, candidates, query_timestamp, edit, keep_prefix=False)
        return scores

    @torch.no_grad()
    def rank_full_keeping_prefix(self, prefix: History, short_term: History,
                                 candidates: Sequence[int] | torch.Tensor, query_timestamp: int | None = None,
                                 edit: HeadBias | None = None) -> tuple[torch.Tensor, PrefixKV]:
        """``rank_full`` that also returns the prefix's KV, which its history pass computes anyway:
        a cache miss then costs one forward, not a prefill followed by a cached rank."""
        scores, kv = self._rank_full(prefix, short_term, candidates, query_timestamp, edit, keep_prefix=True)
        assert kv is not None
        return scores, kv

    def _rank_full(self, prefix: History, short_term: History, candidates: Sequence[int] | torch.Tensor,
                   query_timestamp: int | None, edit: HeadBias | None, *,
                   keep_prefix: bool) -> tuple[torch.Tensor, PrefixKV | None]:
        edit = self._edit_or_none(edit)
        self.check_history(prefix, "prefix", allow_empty=not keep_prefix)
        self.check_history(short_term, "short_term", allow_empty=True)
        history = prefix.concat(short_term)
        if len(history) == 0:
            raise ModelInputError("prefix", "prefix and short-term tokens are both empty; need at least one token")
        cands = self.check_candidates(candidates)
        history = self._to_device(history)
        kv, scores = self._forward(None, history, cands, query_timestamp, edit)
        if not keep_prefix:
            return scores, None
        Tp = len(prefix)
        ts = None if history.timestamps is None else history.timestamps[:Tp]
        prefix_kv = PrefixKV(kv[:, :, :, :Tp].contiguous(), ts, Tp, self.version, edit.content_hash)
        return scores, prefix_kv

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
            _check_range(h.items, f"{name}.items", 0, c.num_items - 1)
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
        _check_range(cands, "candidates", 0, self.config.num_items - 1)
        return cands.to(self.device, torch.int64)

    def _to_device(self, h: History) -> History:
        ts = None if h.timestamps is None else h.timestamps.to(self.device)
        return History(h.items.to(self.device), h.actions.to(self.device), ts)

    # --- the shared forward ------------------------------------------------------------------

    def embed(self, items: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        return (self.item_emb[items] + self.action_emb[actions]) * math.sqrt(self.config.embed_dim)  # [T, E]

    def forward(self, history: History, candidates: torch.Tensor | None = None, *,
                prefix_kv: PrefixKV | None = None, query_timestamp: int | None = None,
                edit: HeadBias | None = None,
                head_capture: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The one forward behind every operation, for training, probing and evaluation.

        Runs ``history`` (after ``prefix_kv`` when given) and the optional ``candidates`` [C] under
        ``edit``; returns (K/V of the history tokens [layers, 2, H, T, D], scores [C] or None).
        Gradients flow when the caller enables them. Inputs are moved to the model's device but not
        checked: the serving entry points (``prefill``, ``rank``, ``rank_full``) check them.
        ``head_capture``, when given, receives per layer the head outputs [rows, H, D] after the edit.
        """
        cands = None if candidates is None else torch.as_tensor(candidates).to(self.device, torch.int64)
        return self._forward(prefix_kv, self._to_device(history), cands, query_timestamp,
                             self._edit_or_none(edit), head_capture)

    def _forward(self, cached: PrefixKV | None, history: History, candidates: torch.Tensor | None,
                 query_timestamp: int | None, edit: HeadBias, head_capture: list[torch.Tensor] | None = None,
                 between_layers: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run new history tokens (after an optional cached prefix) and optional candidates.

        Returns (kv of the new history tokens [layers, 2, H, Tn, D], candidate scores [C] or None).
        ``head_capture``, when given, receives per layer the head outputs [rows, H, D] after the
        edit (the probing point of the editing workflow).
        """
        c = self.config
        H, D = c.num_heads, c.head_dim
        Tp = cached.length if cached is not None else 0
        Tn = len(history)
        C = 0 if candidates is None else int(candidates.shape[0])
        L = Tp + Tn  # history length; candidates sit at position L

        ts_hist = history.timestamps
        ts_prefix = cached.timestamps if cached is not None else None
        use_time = ts_hist is not None or ts_prefix is not None
        if use_time:
            if query_timestamp is None:
                last = ts_hist[-1] if Tn else ts_prefix[-1]
                query_timestamp = int(last)
            ts_cand = torch.full((C,), int(query_timestamp), dtype=torch.int64, device=self.device)
            ts_rows = torch.cat([ts_hist, ts_cand]) if C else ts_hist  # [Tn + C]
        else:
            ts_rows = None

        x_hist = self.embed(history.items, history.actions)  # [Tn, E]
        if C:
            cand_actions = torch.zeros_like(candidates)
            x = torch.cat([x_hist, self.embed(candidates, cand_actions)])  # [Tn + C, E]
        else:
            x = x_hist
        rows = Tn + C
        is_candidate = torch.arange(rows, device=self.device) >= Tn  # [rows]
        # Keys each query row sees (its normaliser): history row at position p → p + 1; candidate → L + 1.
        n_keys = torch.where(is_candidate, torch.full((rows,), float(L + 1), device=self.device),
                             torch.arange(Tp + 1, Tp + rows + 1, device=self.device, dtype=torch.float32))

        new_kv = torch.empty(c.num_layers, 2, H, Tn, D, device=self.device)
        scale = 1.0 / math.sqrt(D)
        ts_cand = None if ts_rows is None else ts_rows[Tn:Tn + 1]  # [1]: one query timestamp for all
        kp = cached.kv[:, 0] if cached is not None else None  # [layers, H, Tp, D]
        vp = cached.kv[:, 1] if cached is not None else None
        for li, layer in enumerate(self.layers):
            if li and between_layers is not None:
                between_layers()
            normed = F.layer_norm(x, (c.embed_dim,))
            uvqk = F.silu(torch.addmm(layer.uvqk_bias, normed, layer.uvqk_weight))  # [rows, 4·H·D]
            u, v, q, k = (t.reshape(rows, H, D).transpose(0, 1) for t in uvqk.split(c.attn_dim, dim=1))
            # v, q, k: [H, rows, D], contiguous; the 1/√D score scale is folded into q once
            q, k, v = q * scale, k.contiguous(), v.contiguous()
            new_kv[li, 0] = k[:, :Tn]
            new_kv[li, 1] = v[:, :Tn]
            parts = []  # A·V, before normalisation, of the history rows then the candidate rows
            if Tn:
                hist = self._attend_causal(layer, q[:, :Tn], k[:, :Tn], v[:, :Tn], ts_hist)  # [H, Tn, D]
                if Tp:
                    hist += self._attend_visible(layer, q[:, :Tn], Tp, ts_hist, kp[li], vp[li], ts_prefix)
                parts.append(hist)
            if C:
                qc = q[:, Tn:]  # [H, C, D]
                cand = torch.zeros(H, C, D, device=self.device)  # every history key, ...
                if Tp:
                    cand += self._attend_visible(layer, qc, L, ts_cand, kp[li], vp[li], ts_prefix, one_position=True)
                if Tn:
                    cand += self._attend_visible(layer, qc, L - Tp, ts_cand, k[:, :Tn], v[:, :Tn], ts_hist,
                                                 one_position=True)
                # ... and itself: position difference 0, time difference 0 (bucket 0 of both biases)
                s_self = (qc * k[:, Tn:]).sum(-1) + layer.pos_bias[:, self.pos_bucket_of_diff[0], None]  # [H, C]
                if ts_rows is not None:
                    s_self = s_self + layer.time_bias[:, 0:1]
                parts.append(cand + F.silu(s_self)[..., None] * v[:, Tn:])
            attn = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)) / n_keys[None, :, None]
            y = F.layer_norm(attn.transpose(0, 1).reshape(rows, c.attn_dim), (c.attn_dim,))
            heads = (y * u.transpose(0, 1).reshape(rows, c.attn_dim)).reshape(rows, H, D)  # [rows, H, D]
            bias = edit.by_layer[li]
            if bias is not None:
                if edit.scope == "all":
                    heads = heads + bias
                else:  # "candidates"
                    heads = heads + bias * is_candidate[:, None, None]
            if head_capture is not None:
                head_capture.append(heads)
            x = x + torch.addmm(layer.out_bias, heads.reshape(rows, c.attn_dim), layer.out_weight)

        scores = None
        if C:
            h_c = F.layer_norm(x[Tn:], (c.embed_dim,))  # [C, E]
            scores = (h_c * self.item_emb[candidates]).sum(-1) / math.sqrt(c.embed_dim)
        return new_kv, scores

    def _attend_causal(self, layer: HSTULayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       ts: torch.Tensor | None) -> torch.Tensor:
        """Un-normalised causal A·V of a run of tokens over its own keys: row i gets Σ_{j≤i} silu(s_ij)·v_j.

        q (pre-scaled), k, v: [H, T, D] → [H, T, D]. Rows and keys are cut into b×b tiles. The
        position bias of a tile pair depends only on how many tiles apart they are, so every pair on
        one block diagonal shares one bias tile and they run as one batched matmul; tiles above the
        diagonal are never computed, and only the diagonal tiles need the causal mask.
        """
        H, T, D = q.shape
        n_tiles = -(-T // min(self.config.block_rows, _CAUSAL_TILE_ROWS))
        b = -(-T // n_tiles)  # the tile size that needs the least padding
        pad = n_tiles * b - T
        if pad:  # zero rows/keys at the end: their rows are dropped, their keys masked (after every row)
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            ts = None if ts is None else F.pad(ts, (0, pad))
        # [tiles, H, b, D]: a run of consecutive tiles is one contiguous batch of (tile, head) matrices
        q_t, k_t, v_t = (t.reshape(H, n_tiles, b, D).transpose(0, 1).contiguous() for t in (q, k, v))
        ts_t = None if ts is None else ts.reshape(n_tiles, b)
        causal = torch.ones(b, b, dtype=torch.bool, device=self.device).tril_()
        pairs_per_step = max(1, _SCORE_TILE_ELEMS // (H * b * b))
        acc = torch.zeros(n_tiles, H, b, D, device=self.device)
        for d in range(n_tiles):  # row tile i against key tile i − d
            pos = self._pos_bias_tile(layer, d * b, b, b)  # [H, b, b]
            for i0 in range(d, n_tiles, pairs_per_step):
                i1 = min(n_tiles, i0 + pairs_per_step)
                m = i1 - i0
                s = torch.matmul(q_t[i0:i1], k_t[i0 - d:i1 - d].transpose(-1, -2))  # [m, H, b, b]
                s.add_(pos)
                if ts_t is not None:
                    dt = ts_t[i0:i1, :, None] - ts_t[i0 - d:i1 - d, None, :]  # [m, b, b]
                    s.add_(self._time_bias(layer, dt).transpose(0, 1))
                F.silu(s, inplace=True)
                if d == 0:
                    s.mul_(causal)
                acc[i0:i1].view(m * H, b, D).baddbmm_(s.view(m * H, b, b), v_t[i0 - d:i1 - d].view(m * H, b, D))
        return acc.transpose(0, 1).reshape(H, n_tiles * b, D)[:, :T]

    def _attend_visible(self, layer: HSTULayer, q: torch.Tensor, first_diff: int, ts_q: torch.Tensor | None,
                        k: torch.Tensor, v: torch.Tensor, ts_k: torch.Tensor | None, *,
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
            bias = self._pos_bias_tile(layer, first_diff - j0, bias_rows, j1 - j0)  # [H, n|1, w]
            if ts_q is not None and ts_k is not None:
                bias = bias + self._time_bias(layer, ts_q[:, None] - ts_k[None, j0:j1])
            s = torch.baddbmm(bias.expand(H, n, j1 - j0), q, k[:, j0:j1].transpose(1, 2))  # [H, n, w]
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
        buckets = _time_buckets(dt, self.config.num_time_buckets)
        return layer.time_bias.index_select(1, buckets.reshape(-1)).view(-1, *dt.shape)


# Scores computed per step, at most: keeps the [H, rows, keys] tiles near the cache (4 MiB of float32).
_SCORE_TILE_ELEMS = 1 << 20
# Rows (and keys) per tile of the causal part; ``ModelConfig.block_rows`` may ask for fewer.
_CAUSAL_TILE_ROWS = 128


def _position_buckets(c: ModelConfig) -> torch.Tensor:
    """Bucket of each position difference 0…max_seq_len: exact below half the buckets, log above."""
    exact = c.num_position_buckets // 2
    d = torch.arange(c.max_seq_len + 2, dtype=torch.float64)
    log_part = exact + torch.log(d.clamp(min=exact) / exact) / math.log(max(c.max_seq_len, exact + 1) / exact) \
        * (c.num_position_buckets - exact - 1)
    return torch.where(d < exact, d, log_part.floor()).clamp(max=c.num_position_buckets - 1).long()


def _time_buckets(dt: torch.Tensor, n: int) -> torch.Tensor:
    """Bucket of a time difference (s): log2-spaced; negative differences fall in bucket 0."""
    return torch.log2(dt.clamp(min=0).float() + 1.0).mul_(2.0).long().clamp_(0, n - 1)


def _check_range(t: torch.Tensor, name: str, lo: int, hi: int) -> None:
    t_min, t_max = int(t.min()), int(t.max())
    if t_min < lo or t_max > hi:
        bad = t_min if t_min < lo else t_max
        raise ModelInputError(name, f"value {bad} out of range [{lo}, {hi}]")
