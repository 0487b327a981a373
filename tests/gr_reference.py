"""Meta's research HSTU (generative-recommenders), for the import tests: random weights in its
state-dict layout, and its forward re-implemented from a reading of its source in plain torch —
nothing here calls RelayGR's model, so the importer's mapping is checked against an independent
computation.

The reference, per layer: ``x += W_o(u ⊙ LN(A·v)) + b_o`` with ``u, v, q, k = silu(LN(x) @ W_uvqk)``
(no bias, no 1/√d), ``A = silu(q·kᵀ + b_pos + b_time) / N`` causal, where N is the padded length
every input has; ``b_pos[i, j] = pos_w[N − 1 + j − i]``; ``b_time[i, j] = ts_w[bucket(t_{i+1} − t_j)]``
(a row's time is the next token's; the last real row's is the target's, written into the next
slot), ``bucket(Δ) = ⌊ln(max(|Δ|, 1)) / 0.301⌋`` clamped to the table; no bias at all without
timestamps. Input: ``item_emb · √E + pos_emb[position]``. Output: the last real position,
L2-normalised (or layer-normalised), dotted with the (L2-normalised) item embeddings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-6
NUM_TIME_BUCKETS = 128  # the reference's HSTU hard-codes 128 (+1 table entries)


def reference_state(*, num_items: int, embed_dim: int, seq_len: int, num_layers: int, num_heads: int,
                    dqk: int, dv: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights named and shaped as the reference's ``HSTU.state_dict()`` (DotProduct similarity,
    LocalEmbeddingModule, LearnablePositionalEmbeddingInputFeaturesPreprocessor)."""
    g = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    E, N, H = embed_dim, seq_len, num_heads
    state = {
        "_embedding_module._item_emb.weight": normal(num_items + 1, E, std=0.5),
        "_input_features_preproc._pos_emb.weight": normal(N, E, std=0.5),
        "_attn_mask": torch.triu(torch.ones(N, N, dtype=torch.bool), diagonal=1),
    }
    for i in range(num_layers):
        p = f"_hstu._attention_layers.{i}."
        state |= {
            p + "_uvqk": normal(E, 2 * H * dv + 2 * H * dqk, std=1.0 / E ** 0.5),
            p + "_o.weight": normal(E, H * dv, std=1.0 / (H * dv) ** 0.5),
            p + "_o.bias": normal(E, std=0.1),
            p + "_rel_attn_bias._ts_w": normal(NUM_TIME_BUCKETS + 1, std=1.0),
            p + "_rel_attn_bias._pos_w": normal(2 * N - 1, std=1.0),
        }
    return state


def reference_scores(state: dict[str, torch.Tensor], *, num_heads: int, items: torch.Tensor,
                     timestamps: torch.Tensor | None, target_timestamp: int | None, candidates: torch.Tensor,
                     user_embedding_norm: str = "l2_norm", item_l2_norm: bool = True) -> torch.Tensor:
    """[C] scores of one user's history (item ids ≥ 1, [n]) for candidates [C], as the reference's
    eval computes them: encode, take the last position, dot product with the item embeddings."""
    item_table = state["_embedding_module._item_emb.weight"]
    pos_table = state["_input_features_preproc._pos_emb.weight"]
    N, E = pos_table.shape
    n, H = len(items), num_heads
    x = item_table[items] * E ** 0.5 + pos_table[:n]  # [n, E]; ids ≥ 1, so no row is padding

    bias = None
    if timestamps is not None:
        padded = torch.zeros(N, dtype=torch.int64)
        padded[:n] = timestamps
        if n < N:
            padded[n] = target_timestamp  # the eval features put the target's time after the history
        ext = torch.cat([padded, padded[N - 1:]])  # [N + 1]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        buckets = (torch.log((ext[1:n + 1, None] - ext[None, :n]).abs().clamp(min=1)) / 0.301).long()
        buckets = buckets.clamp(0, NUM_TIME_BUCKETS)
    causal = torch.ones(n, n).tril()
    for li in range(sum(1 for k in state if k.endswith("._uvqk"))):
        p = f"_hstu._attention_layers.{li}."
        uvqk_w, o_w, o_b = state[p + "_uvqk"], state[p + "_o.weight"], state[p + "_o.bias"]
        dv = o_w.shape[1] // H
        dqk = (uvqk_w.shape[1] - 2 * H * dv) // (2 * H)
        if timestamps is not None:
            bias = state[p + "_rel_attn_bias._pos_w"][N - 1 + j - i] + state[p + "_rel_attn_bias._ts_w"][buckets]
        u, v, q, k = F.silu(F.layer_norm(x, (E,), eps=EPS) @ uvqk_w).split([H * dv, H * dv, H * dqk, H * dqk], 1)
        s = torch.einsum("ihd,jhd->hij", q.reshape(n, H, dqk), k.reshape(n, H, dqk))  # [H, n, n]
        if bias is not None:
            s = s + bias
        a = F.silu(s) / N * causal
        o = torch.einsum("hij,jhd->ihd", a, v.reshape(n, H, dv)).reshape(n, H * dv)
        x = x + (u * F.layer_norm(o, (H * dv,), eps=EPS)) @ o_w.T + o_b
    h = x[n - 1]
    if user_embedding_norm == "l2_norm":
        user = h / h.norm().clamp(min=EPS)
    else:
        user = F.layer_norm(h, (E,), eps=EPS)
    it = item_table[candidates]
    if item_l2_norm:
        it = it / it.norm(dim=-1, keepdim=True).clamp(min=EPS)
    return it @ user
