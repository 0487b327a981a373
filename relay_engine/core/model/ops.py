"""HSTU attention: the kernels behind every layer of ``HSTUModel``, and the one switch that picks one.

A kernel takes one layer's projected rows (history rows, then candidate rows), the cached prefix's
K/V, how the rows see their keys (``AttentionRows``, the same for every layer of a forward) and the
layer's relative bias (``RelativeBias``), and returns the normalised A·V of every row. Attention is
pointwise: row i gets Σ_j silu(q_i·k_j + bias_ij)·v_j over the keys it sees, divided by its
normaliser. History rows see the prefix and the history rows up to their own; a candidate row sees
the prefix, every history row and itself, all from one position just after the history.

``pytorch_attention`` is the only kernel today: tiled matmuls that keep scores cache-sized on any
device. A fused or device kernel (Triton on CUDA, an Ascend op through torch_npu) registers in
``ATTENTION_KERNELS`` and is named for its device in ``KERNEL_BY_DEVICE_TYPE``; it must give the same
scores, and the cached path the same as the full one (``tests/core/test_model.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F

from relay_engine.core.model.options import ModelConfig

# Scores computed per step, at most: keeps the [H, rows, keys] tiles near the cache (4 MiB of float32).
_SCORE_TILE_ELEMS = 1 << 20
# Rows (and keys) per tile of the causal part; ``ModelConfig.block_rows`` may ask for fewer.
_CAUSAL_TILE_ROWS = 128
# Bucket indices one forward keeps for its later layers (``BucketMemo``): a 2048-token prefill's time
# buckets are 9 MiB; a longer one keeps its first tiles' and computes the rest in every layer.
_MEMO_BYTES = 16 * 2**20


@dataclass(frozen=True)
class AttentionRows:
    """Which keys the rows of one forward see, when they query, and what divides their A·V."""

    n_prefix: int  # Tp: cached keys, before every row
    n_history: int  # Tn: history rows, causal among themselves, at positions Tp…Tp + Tn − 1
    n_candidates: int  # C: candidate rows, at position L = Tp + Tn
    n_keys: torch.Tensor  # [Tn + C]: each row's normaliser (``ModelConfig.attn_normaliser``)
    ts_prefix: torch.Tensor | None  # [Tp]: the prefix keys' times
    ts_history: torch.Tensor | None  # [Tn]: the history keys' times
    ts_query: torch.Tensor | None  # [Tn]: the time each history row queries at (``ModelConfig.query_time``)
    ts_candidates: torch.Tensor | None  # [1]: the time the candidates query at
    use_position: bool  # whether the position bias applies (``ModelConfig.bias_needs_timestamps``)
    max_tile_rows: int  # ``ModelConfig.block_rows``


class BucketMemo:
    """The bucket indices of one forward's bias tiles, kept by its first layer for the others.

    They depend only on positions and times, which every layer of a forward shares (each layer has
    its own weights per bucket); recomputing them was most of the time bias's cost (a log per score,
    in every layer). Keeps up to ``budget_bytes``; past it, a tile's indices are computed each time.
    One per forward: never shared between forwards or threads.
    """

    def __init__(self, budget_bytes: int = _MEMO_BYTES):
        self._tiles: dict[tuple, torch.Tensor] = {}
        self._left = budget_bytes

    def get(self, key: tuple, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._tiles.get(key)
        if found is not None:
            return found
        found = compute()
        nbytes = found.numel() * found.element_size()
        if nbytes <= self._left:
            self._tiles[key], self._left = found, self._left - nbytes
        return found


@dataclass(frozen=True)
class RelativeBias:
    """One layer's relative attention bias: per head, a weight per position bucket and per time bucket."""

    position: torch.Tensor  # [H, num_position_buckets]
    time: torch.Tensor  # [H, num_time_buckets]
    bucket_of_diff: torch.Tensor  # [max_seq_len + 2]: the position bucket of each distance (``position_buckets``)
    time_buckets: str  # ``ModelConfig.time_buckets``
    memo: BucketMemo | None = None  # the forward's, shared by its layers; None: computed every time

    def position_tile(self, first_diff: int, n_rows: int, n_keys: int) -> torch.Tensor:
        """[H, n_rows, n_keys]: the position bias of row i against key j, first_diff + i − j positions
        apart (negative differences, masked pairs, read difference 0). A Toeplitz matrix, so it is
        one strided copy of a short vector rather than a gather per element."""
        def buckets() -> torch.Tensor:
            table = self.bucket_of_diff
            diffs = torch.arange(first_diff - n_keys + 1, first_diff + n_rows, device=table.device)
            return table.index_select(0, diffs.clamp_(0, table.numel() - 1))  # [n_rows + n_keys − 1]

        idx = buckets() if self.memo is None else self.memo.get(("position", first_diff, n_rows, n_keys), buckets)
        w = self.position.index_select(1, idx)  # [H, n_rows + n_keys − 1]
        # hankel[h, i, j'] = w[h, i + j']; with j' = n_keys − 1 − j that is the bias at first_diff + i − j
        return w.as_strided((w.shape[0], n_rows, n_keys), (w.stride(0), 1, 1)).flip(-1)

    def time_tile(self, ts_q: torch.Tensor, ts_k: torch.Tensor, key: tuple) -> torch.Tensor:
        """[H, *(ts_q − ts_k).shape]: the time bias of each time difference (s) between a query and a
        key (``ts_q`` and ``ts_k`` broadcast); ``key`` names the tile within its forward (the memo's)."""
        def buckets() -> torch.Tensor:
            return time_buckets(ts_q - ts_k, self.time.shape[1], self.time_buckets).int()  # int32: half the memo

        idx = buckets() if self.memo is None else self.memo.get(("time", *key), buckets)
        return self.time.index_select(1, idx.reshape(-1)).view(-1, *idx.shape)


class AttentionKernel(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor | None,
                 prefix_v: torch.Tensor | None, rows: AttentionRows, bias: RelativeBias, *,
                 between_steps: Callable[[], None] | None = None) -> torch.Tensor:
        """q (pre-scaled), k, v: [H, Tn + C, D]; prefix_k, prefix_v: [H, Tp, D] or None when Tp = 0.
        Returns the normalised A·V [H, Tn + C, D]. ``between_steps``, when given, is called between
        the kernel's steps (never before the first): where a prefill yields to ranking."""
        ...


def pytorch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_k: torch.Tensor | None,
                      prefix_v: torch.Tensor | None, rows: AttentionRows, bias: RelativeBias, *,
                      between_steps: Callable[[], None] | None = None) -> torch.Tensor:
    """The attention of every row, as ``AttentionKernel`` says, in tiled PyTorch matmuls."""
    H, _, D = q.shape
    Tp, Tn, C = rows.n_prefix, rows.n_history, rows.n_candidates
    L = Tp + Tn
    use_pos = rows.use_position
    # A·V before normalisation, of the history rows then the candidate rows. Every row sees the whole
    # prefix: history rows and candidates take it in one GEMM per chunk of keys, each with its own bias.
    if Tp:
        runs = [_QueryRun(0, Tn, Tp, False, rows.ts_query, "history rows, prefix keys"),
                _QueryRun(Tn, Tn + C, L, True, rows.ts_candidates, "candidates, prefix keys")]
        out = _attend_visible(bias, q, [r for r in runs if r.stop > r.start], prefix_k, prefix_v, rows.ts_prefix,
                              use_pos)
    else:
        out = torch.zeros(H, Tn + C, D, device=q.device)
    if Tn:
        out[:, :Tn].add_(_attend_causal(bias, q[:, :Tn], k[:, :Tn], v[:, :Tn], rows.ts_query, rows.ts_history,
                                        use_pos, rows.max_tile_rows, between_steps))
    if C:
        qc, cand = q[:, Tn:], out[:, Tn:]  # [H, C, D]: the candidates see every history key, ...
        if Tn:
            cand += _attend_visible(bias, qc, [_QueryRun(0, C, L - Tp, True, rows.ts_candidates,
                                                         "candidates, history keys")],
                                    k[:, :Tn], v[:, :Tn], rows.ts_history, use_pos)
        # ... and itself: distance 0, time difference 0 (bucket 0 under every bucket function)
        s_self = (qc * k[:, Tn:]).sum(-1)  # [H, C]
        if use_pos:
            s_self = s_self + bias.position[:, bias.bucket_of_diff[0], None]
        if rows.ts_candidates is not None:
            s_self = s_self + bias.time[:, 0:1]
        cand += F.silu(s_self)[..., None] * v[:, Tn:]
    return out.div_(rows.n_keys[None, :, None])


# Kernels by name, and the one each device type runs (a type not named runs "pytorch").
ATTENTION_KERNELS: dict[str, AttentionKernel] = {"pytorch": pytorch_attention}
KERNEL_BY_DEVICE_TYPE: dict[str, str] = {"cpu": "pytorch", "cuda": "pytorch", "npu": "pytorch"}


def attention_kernel(device: torch.device) -> AttentionKernel:
    """The switch: the attention kernel for a model on ``device``."""
    return ATTENTION_KERNELS[KERNEL_BY_DEVICE_TYPE.get(device.type, "pytorch")]


def _attend_causal(bias: RelativeBias, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   ts_q: torch.Tensor | None, ts_k: torch.Tensor | None, use_pos: bool,
                   max_tile_rows: int, between_steps: Callable[[], None] | None = None) -> torch.Tensor:
    """Un-normalised causal A·V of a run of tokens over its own keys: row i gets Σ_{j≤i} silu(s_ij)·v_j.

    q (pre-scaled), k, v: [H, T, D] → [H, T, D]; ts_q, ts_k: [T] query and key times, or None.
    Rows and keys are cut into b×b tiles. The position bias of a tile pair depends only on how
    many tiles apart they are, so every pair on one block diagonal shares one bias tile and they
    run as one batched matmul; tiles above the diagonal are never computed, and only the
    diagonal tiles need the causal mask. ``between_steps`` is called between two batched steps.
    """
    H, T, D = q.shape
    n_tiles = -(-T // min(max_tile_rows, _CAUSAL_TILE_ROWS))
    b = -(-T // n_tiles)  # the tile size that needs the least padding
    pad = n_tiles * b - T
    if pad:  # zero rows/keys at the end: their rows are dropped, their keys masked (after every row)
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        ts_q, ts_k = (None if t is None else F.pad(t, (0, pad)) for t in (ts_q, ts_k))
    # [tiles, H, b, D]: a run of consecutive tiles is one contiguous batch of (tile, head) matrices
    q_t, k_t, v_t = (t.reshape(H, n_tiles, b, D).transpose(0, 1).contiguous() for t in (q, k, v))
    tq_t, tk_t = (None if t is None else t.reshape(n_tiles, b) for t in (ts_q, ts_k))
    causal = torch.ones(b, b, dtype=torch.bool, device=q.device).tril_()
    pairs_per_step = max(1, _SCORE_TILE_ELEMS // (H * b * b))
    acc = torch.zeros(n_tiles, H, b, D, device=q.device)
    for d in range(n_tiles):  # row tile i against key tile i − d
        pos = bias.position_tile(d * b, b, b) if use_pos else None  # [H, b, b]
        for i0 in range(d, n_tiles, pairs_per_step):
            i1 = min(n_tiles, i0 + pairs_per_step)
            m = i1 - i0
            if between_steps is not None and (d or i0):
                between_steps()
            s = torch.matmul(q_t[i0:i1], k_t[i0 - d:i1 - d].transpose(-1, -2))  # [m, H, b, b]
            if pos is not None:
                s.add_(pos)
            if tq_t is not None:
                time = bias.time_tile(tq_t[i0:i1, :, None], tk_t[i0 - d:i1 - d, None, :], ("causal", b, d, i0, i1))
                s.add_(time.transpose(0, 1))  # [H, m, b, b] → [m, H, b, b]
            F.silu(s, inplace=True)
            if d == 0:
                s.mul_(causal)
            acc[i0:i1].view(m * H, b, D).baddbmm_(s.view(m * H, b, b), v_t[i0 - d:i1 - d].view(m * H, b, D))
    return acc.transpose(0, 1).reshape(H, n_tiles * b, D)[:, :T]


class _QueryRun(NamedTuple):
    """Rows start…stop − 1 of a forward's queries, which see a run of keys whole: row i and key j are
    first_diff + (i − start) − j positions apart, or first_diff − j for every row when ``one_position``
    (the candidates: one position and one timestamp, ts_q [1], so their bias is one row, broadcast).
    ``which`` names the rows and the keys (the bucket memo's key)."""

    start: int
    stop: int
    first_diff: int
    one_position: bool
    ts_q: torch.Tensor | None
    which: str


def _attend_visible(bias: RelativeBias, q: torch.Tensor, runs: list[_QueryRun], k: torch.Tensor, v: torch.Tensor,
                    ts_k: torch.Tensor | None, use_pos: bool) -> torch.Tensor:
    """Un-normalised A·V of rows over keys that every row sees whole.

    q (pre-scaled): [H, n, D]; k, v: [H, T, D] → [H, n, D]; ``runs`` cover the rows, each with its
    own bias. Keys are taken in chunks so the [H, n, chunk] scores stay cache-sized; each chunk is
    one GEMM for every row, the biases added after it (baddbmm would first copy a broadcast bias
    into the scores).
    """
    H, n, D = q.shape
    T = k.shape[1]
    out = torch.zeros(H, n, D, device=q.device)
    chunk = max(1, _SCORE_TILE_ELEMS // (H * n))
    for j0 in range(0, T, chunk):
        j1 = min(T, j0 + chunk)
        s = torch.bmm(q, k[:, j0:j1].transpose(1, 2))  # [H, n, w]
        for run in runs:
            rows = s[:, run.start:run.stop]
            if use_pos:
                rows.add_(bias.position_tile(run.first_diff - j0, 1 if run.one_position else run.stop - run.start,
                                             j1 - j0))  # [H, n|1, w]
            if run.ts_q is not None and ts_k is not None:
                rows.add_(bias.time_tile(run.ts_q[:, None], ts_k[None, j0:j1], (run.which, j0, j1)))  # [H, n|1, w]
        out.baddbmm_(F.silu(s, inplace=True), v[:, j0:j1])
    return out


def position_buckets(c: ModelConfig) -> torch.Tensor:
    """Bucket of each position difference 0…max_seq_len + 1: one per difference ("exact", the last
    bucket taking the rest), or exact below half the buckets and log-spaced above ("log")."""
    d = torch.arange(c.max_seq_len + 2, dtype=torch.float64)
    if c.position_buckets == "exact":
        return d.clamp(max=c.num_position_buckets - 1).long()
    exact = c.num_position_buckets // 2
    log_part = exact + torch.log(d.clamp(min=exact) / exact) / math.log(max(c.max_seq_len, exact + 1) / exact) \
        * (c.num_position_buckets - exact - 1)
    return torch.where(d < exact, d, log_part.floor()).clamp(max=c.num_position_buckets - 1).long()


def time_buckets(dt: torch.Tensor, n: int, kind: str) -> torch.Tensor:
    """Bucket of a time difference (s). "sqrt2": log2-spaced twice per octave, negative differences
    in bucket 0; "gr": ⌊ln(max(|Δt|, 1)) / 0.301⌋ in float32, as the reference HSTU buckets."""
    if kind == "gr":
        return (torch.log(dt.abs().clamp_(min=1).float()) / 0.301).long().clamp_(0, n - 1)
    return torch.log2(dt.clamp(min=0).float() + 1.0).mul_(2.0).long().clamp_(0, n - 1)
