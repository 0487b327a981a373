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
candidates. This module holds the parameters and the sequencing of the layers; the attention is
``ops`` (one switch picks its kernel by device), the weights file format ``checkpoint``, the input
checks ``checks``, and the tensors of an edit ``relay_engine.core.edit_tensors``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from relay_engine.core.config import EditingConfig
from relay_engine.core.edit_tensors import EditTensors
from relay_engine.core.model import checks
from relay_engine.core.model.checkpoint import (
    WeightsFileError,
    copy_weights,
    read_weights,
    weights_version,
    write_weights,
)
from relay_engine.core.model.ops import (
    AttentionRows,
    BucketMemo,
    RelativeBias,
    attention_kernel,
    position_buckets,
)
from relay_engine.core.model.options import ModelConfig
from relay_engine.core.model.values import History, ModelInputError, PrefixKV


class HSTULayer(nn.Module):
    """One HSTU block's parameters (its computation is ``HSTUModel._forward``'s loop body)."""

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
        self.register_buffer("pos_bucket_of_diff", position_buckets(c), persistent=False)
        self.version = c.version()
        self.to(device)

    @property
    def device(self) -> torch.device:
        return self.item_emb.device

    # --- the operations: prefill, rank (cached), rank_full (the baseline), forward (the lab's) ---

    @torch.no_grad()
    def prefill(self, prefix: History, edit: EditTensors | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV:
        """Pre-infer a long-term prefix: its per-layer K/V, ready for ``rank``, under ``edit`` (none by default).
        ``between_layers`` is called between the prefill's steps, where pre-inference yields to ranking:
        before every layer but the first, before and after each layer's attention (a layer's longest
        step) and between the attention's batched tile steps, so a rank that arrives mid-layer waits
        for one step, not the rest of the layer."""
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
        checks.check_cached_rank(self.config, prefix_kv, short_term, model_version=self.version,
                                 edit_hash=edit.content_hash, device=self.device)
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

    def prefix_nbytes(self, seq_len: int, with_timestamps: bool) -> int:
        """Exact size of the PrefixKV that ``prefill`` returns for seq_len tokens."""
        tail = 1 if self.config.carries_tail else 0
        tail_bytes = tail * 8 * (3 if with_timestamps else 2)  # items, actions (and timestamps), int64
        return (seq_len - tail) * self.config.kv_bytes_per_token(with_timestamps) + tail_bytes

    # --- weights files (the format: ``checkpoint``) ---------------------------------------------

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: Mapping[str, torch.Tensor],
                        device: torch.device | str = "cpu") -> HSTUModel:
        """A model with these weights (names and shapes as ``state_dict()`` has them). Raises
        ValueError naming the first parameter missing, unexpected, mis-shaped or not finite. Its
        ``version`` hashes the weights, so caches never mix two sets of them."""
        model = cls(config)
        own = model.state_dict()
        copy_weights(own, state)
        model.version = weights_version(config, own)
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
        write_weights(path, self.config, self.state_dict(), source=source)

    # --- edits and input checks (``checks``) ----------------------------------------------------

    def no_edit(self) -> EditTensors:
        return EditTensors.none(self.config.num_layers)

    def edit_from(self, editing: EditingConfig | None) -> EditTensors:
        """Turn an editing configuration into per-layer biases and low-rank maps, checking it fits this model."""
        if editing is None or editing.is_empty:
            return self.no_edit()
        checks.check_editing(self.config, editing)
        return EditTensors.from_editing(editing, self.device)

    def check_history(self, h: History, name: str, *, allow_empty: bool) -> None:
        checks.check_history(self.config, h, name, allow_empty=allow_empty)

    def check_candidates(self, candidates: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The candidates as a [C] int64 tensor on the model's device, or ModelInputError."""
        return checks.check_candidates(self.config, candidates, self.device)

    def _edit_or_none(self, edit: EditTensors | None) -> EditTensors:
        if edit is None:
            return self.no_edit()
        checks.check_edit(self.config, edit)
        return edit

    # --- the shared forward --------------------------------------------------------------------

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

    def embed(self, items: torch.Tensor, actions: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Input embeddings [T, E] of tokens at absolute ``positions`` [T] (counted from the start of
        the history; they matter only with ``ModelConfig.input_positions``)."""
        # index_select: a plain row gather, several times faster than advanced indexing on CPU
        x = self.item_emb.index_select(0, items).add_(self.action_emb.index_select(0, actions))
        x.mul_(math.sqrt(self.config.embed_dim))  # [T, E]
        return x if self.pos_emb is None else x.add_(self.pos_emb.index_select(0, positions))

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
        C = 0 if candidates is None else int(candidates.shape[0])
        cand_rows = C if c.scoring == "candidate_tokens" else 0  # candidates that run as tokens
        if C and not cand_rows and not len(history):
            raise ModelInputError("history", "is empty; scoring by the last position needs at least one token")
        attn_rows = self._attention_rows(cached, history, cand_rows, query_timestamp)
        Tp, Tn = attn_rows.n_prefix, attn_rows.n_history
        L = Tp + Tn  # history length; candidate tokens sit at position L

        x = self.embed(history.items, history.actions, torch.arange(Tp, L, device=self.device))  # [Tn, E]
        if cand_rows:
            cand_pos = torch.full((C,), L, dtype=torch.int64, device=self.device)
            x = torch.cat([x, self.embed(candidates, torch.zeros_like(candidates), cand_pos)])  # [Tn + C, E]
        rows = Tn + cand_rows

        attend = attention_kernel(self.device)
        new_kv = torch.empty(c.num_layers, 2, H, Tn, D, device=self.device)
        scale = 1.0 / math.sqrt(D) if c.attn_scale == "rsqrt_dim" else 1.0
        memo = BucketMemo()  # the bias tiles' bucket indices, computed by the first layer for all of them
        for li, layer in enumerate(self.layers):
            if li and between_layers is not None:
                between_layers()
            normed = F.layer_norm(x, (E,), eps=c.ln_eps)
            uvqk = F.silu(torch.addmm(layer.uvqk_bias, normed, layer.uvqk_weight), inplace=True)  # [rows, 4·H·D]
            u, v, q, k = (t.reshape(rows, H, D).transpose(0, 1) for t in uvqk.split(c.attn_dim, dim=1))
            # v, q, k: [H, rows, D], contiguous; the score scale is folded into q once
            q, k, v = q * scale, k.contiguous(), v.contiguous()
            new_kv[li, 0] = k[:, :Tn]
            new_kv[li, 1] = v[:, :Tn]
            prefix_k, prefix_v = (None, None) if cached is None else (cached.kv[li, 0], cached.kv[li, 1])
            bias = RelativeBias(layer.pos_bias, layer.time_bias, self.pos_bucket_of_diff, c.time_buckets, memo)
            if between_layers is not None:
                between_layers()
            attn = attend(q, k, v, prefix_k, prefix_v, attn_rows, bias, between_steps=between_layers)  # [H, rows, D]
            if between_layers is not None:
                between_layers()
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

    def _attention_rows(self, cached: PrefixKV | None, history: History, n_candidates: int,
                        query_timestamp: int | None) -> AttentionRows:
        """Which keys the rows of a forward see, when they query and what divides their A·V (the
        same in every layer). ``history`` includes the cached prefix's tail, if it has one."""
        c = self.config
        Tp = cached.settled if cached is not None else 0
        Tn = len(history)
        L = Tp + Tn
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
        rows = Tn + n_candidates
        if c.attn_normaliser == "row":
            # Keys each query row sees: history row at position p → p + 1; candidate → L + 1.
            is_candidate = torch.arange(rows, device=self.device) >= Tn  # [rows]
            n_keys = torch.where(is_candidate, torch.full((rows,), float(L + 1), device=self.device),
                                 torch.arange(Tp + 1, Tp + rows + 1, device=self.device, dtype=torch.float32))
        else:
            n_keys = torch.full((rows,), float(c.max_seq_len), device=self.device)
        return AttentionRows(Tp, Tn, n_candidates, n_keys, ts_prefix, ts_hist, ts_query, ts_cand,
                             use_position=use_time or not c.bias_needs_timestamps, max_tile_rows=c.block_rows)

    def _output_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The scoring rows [..., E], normalised as ``ModelConfig.output_norm`` says."""
        if self.config.output_norm == "layer":
            return F.layer_norm(h, (self.config.embed_dim,), eps=self.config.ln_eps)
        return h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp(min=self.config.ln_eps)

    def _item_vectors(self, items: torch.Tensor) -> torch.Tensor:
        """[C, E]: the embeddings candidates are scored against (L2-normalised with ``item_l2_norm``)."""
        e = self.item_emb.index_select(0, items)
        if self.config.item_l2_norm:
            e = e / torch.linalg.vector_norm(e, dim=-1, keepdim=True).clamp(min=self.config.ln_eps)
        return e
