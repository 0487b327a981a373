"""The attention kernels' contract: every registered kernel computes HSTU's pointwise attention as its
dense definition says, and every device the engine can bind to has one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relay_engine.core.model import ModelConfig
from relay_engine.core.model.ops import (
    ATTENTION_KERNELS,
    KERNEL_BY_DEVICE_TYPE,
    AttentionRows,
    BucketMemo,
    RelativeBias,
    attention_kernel,
    position_buckets,
    pytorch_attention,
    time_buckets,
)


def dense_attention(q, k, v, prefix_k, prefix_v, rows: AttentionRows, bias: RelativeBias) -> torch.Tensor:
    """Row by row, key by key: Σ_j silu(q_i·k_j + position bias + time bias)·v_j / n_keys_i."""
    H, _, D = q.shape
    Tp, Tn, C = rows.n_prefix, rows.n_history, rows.n_candidates
    pk, pv = (prefix_k, prefix_v) if Tp else (torch.empty(H, 0, D), torch.empty(H, 0, D))
    keys_k, keys_v = torch.cat([pk, k[:, :Tn]], 1), torch.cat([pv, v[:, :Tn]], 1)  # [H, Tp + Tn, D]
    ts_keys = None if rows.ts_candidates is None else \
        torch.cat([t for t in (rows.ts_prefix, rows.ts_history) if t is not None])  # [Tp + Tn]
    out = torch.zeros(H, Tn + C, D)
    for i in range(Tn + C):
        if i < Tn:  # a history row at position Tp + i sees keys 0…Tp + i
            pos, seen = Tp + i, Tp + i + 1
            kk, vv = keys_k[:, :seen], keys_v[:, :seen]
            ts_q = None if rows.ts_query is None else rows.ts_query[i]
            key_pos = torch.arange(seen)
            ts_k = None if ts_keys is None else ts_keys[:seen]
        else:  # a candidate at position L sees every history key and itself (at distance 0)
            pos = Tp + Tn
            kk, vv = torch.cat([keys_k, k[:, i:i + 1]], 1), torch.cat([keys_v, v[:, i:i + 1]], 1)
            ts_q = None if rows.ts_candidates is None else rows.ts_candidates[0]
            key_pos = torch.cat([torch.arange(Tp + Tn), torch.tensor([pos])])
            ts_k = None if ts_keys is None else torch.cat([ts_keys, rows.ts_candidates])
        s = torch.einsum("hd,hjd->hj", q[:, i], kk)  # [H, keys]
        if rows.use_position:
            s = s + bias.position[:, bias.bucket_of_diff[pos - key_pos]]
        if ts_q is not None:
            s = s + bias.time[:, time_buckets(ts_q - ts_k, bias.time.shape[1], bias.time_buckets)]
        out[:, i] = torch.einsum("hj,hjd->hd", F.silu(s), vv) / rows.n_keys[i]
    return out


CONFIG = ModelConfig(num_items=10, embed_dim=8, num_layers=1, num_heads=2, head_dim=4, max_seq_len=300,
                     num_position_buckets=16, num_time_buckets=24, block_rows=8)


def inputs(Tp: int, Tn: int, C: int, *, timestamps: bool, use_position: bool, time_kind: str):
    g = torch.Generator().manual_seed(Tp * 1000 + Tn * 10 + C)
    H, D, rows = CONFIG.num_heads, CONFIG.head_dim, Tn + C
    q, k, v = (torch.randn(H, rows, D, generator=g) for _ in range(3))
    # as the model passes them: no prefix tensors at all without a cached prefix
    prefix_k, prefix_v = (torch.randn(H, Tp, D, generator=g), torch.randn(H, Tp, D, generator=g)) if Tp \
        else (None, None)
    ts = torch.cumsum(torch.randint(0, 4000, (Tp + Tn + 1,), generator=g), 0)
    ts_prefix, ts_hist, ts_cand = (ts[:Tp] if Tp else None, ts[Tp:Tp + Tn], ts[-1:]) if timestamps \
        else (None, None, None)
    ts_query = None if ts_hist is None else torch.cat([ts_hist, ts_cand])[1:]  # the next token's time
    n_keys = torch.cat([torch.arange(Tp + 1, Tp + Tn + 1), torch.full((C,), Tp + Tn + 1)]).float()
    rows_ = AttentionRows(Tp, Tn, C, n_keys, ts_prefix, ts_hist, ts_query, ts_cand, use_position,
                          CONFIG.block_rows)
    bias = RelativeBias(torch.randn(H, CONFIG.num_position_buckets, generator=g),
                        torch.randn(H, CONFIG.num_time_buckets, generator=g), position_buckets(CONFIG), time_kind)
    return q, k, v, prefix_k, prefix_v, rows_, bias


@pytest.mark.parametrize("kernel", sorted(ATTENTION_KERNELS))
@pytest.mark.parametrize(("Tp", "Tn", "C"), [(0, 1, 0), (0, 5, 3), (4, 0, 2), (7, 19, 0), (13, 30, 4), (0, 33, 1)])
@pytest.mark.parametrize(("timestamps", "use_position", "time_kind"),
                         [(False, True, "sqrt2"), (True, True, "sqrt2"), (True, False, "gr"), (False, False, "gr")])
def test_every_kernel_computes_the_dense_definition(kernel, Tp, Tn, C, timestamps, use_position, time_kind):
    args = inputs(Tp, Tn, C, timestamps=timestamps, use_position=use_position, time_kind=time_kind)
    got = ATTENTION_KERNELS[kernel](*args)
    assert got.shape == (CONFIG.num_heads, Tn + C, CONFIG.head_dim)
    torch.testing.assert_close(got, dense_attention(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget_bytes", [16 * 2**20, 0, 600])
@pytest.mark.parametrize(("Tp", "Tn", "C"), [(0, 33, 1), (13, 30, 4), (4, 0, 2)])
def test_layers_sharing_one_bucket_memo_each_compute_the_dense_definition_with_their_own_weights(Tp, Tn, C,
                                                                                              budget_bytes):
    # As the model runs them: every layer of a forward shares one memo (the first layer's buckets
    # reused by the next), whatever part of them fits its budget (0: none; 600 bytes: a few tiles).
    q, k, v, prefix_k, prefix_v, rows, first = inputs(Tp, Tn, C, timestamps=True, use_position=True,
                                                      time_kind="sqrt2")
    memo = BucketMemo(budget_bytes)
    g = torch.Generator().manual_seed(7)
    second = RelativeBias(torch.randn(first.position.shape, generator=g), torch.randn(first.time.shape, generator=g),
                          first.bucket_of_diff, first.time_buckets, memo)
    first = RelativeBias(first.position, first.time, first.bucket_of_diff, first.time_buckets, memo)
    for bias in (first, second):
        got = pytorch_attention(q, k, v, prefix_k, prefix_v, rows, bias)
        torch.testing.assert_close(got, dense_attention(q, k, v, prefix_k, prefix_v, rows, bias), rtol=1e-5, atol=1e-5)


def test_every_device_kind_the_engine_binds_to_has_a_registered_kernel():
    assert set(KERNEL_BY_DEVICE_TYPE) >= {"npu", "cuda", "cpu"}
    assert all(name in ATTENTION_KERNELS for name in KERNEL_BY_DEVICE_TYPE.values())


def test_a_device_type_not_listed_runs_the_pytorch_kernel():
    assert "meta" not in KERNEL_BY_DEVICE_TYPE
    assert attention_kernel(torch.device("meta")) is pytorch_attention
