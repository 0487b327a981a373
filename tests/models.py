"""Small model configurations and histories shared by the core and lab tests."""

from __future__ import annotations

import torch

from relay_engine.core.config import ModelFingerprint
from relay_engine.core.model import History, ModelConfig

TOLERANCE = 1e-5  # max abs error relative to the scores' max abs value, float32

SMALL = ModelConfig(num_items=1000, num_actions=6, embed_dim=32, num_layers=2, num_heads=2, head_dim=8,
                    max_seq_len=8192, block_rows=64)


def make_history(length: int, config: ModelConfig, *, seed: int, timestamps: bool = False,
                 t0: int = 1_000_000) -> History:
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(config.min_item_id, config.num_items, (length,), generator=g)
    actions = torch.randint(1, config.num_actions, (length,), generator=g)
    ts = t0 + torch.cumsum(torch.randint(0, 5000, (length,), generator=g), 0) if timestamps else None
    return History(items, actions, ts)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def random_lowrank(fingerprint: ModelFingerprint, *, seed: int, scope: str = "candidates", rank: int = 2,
                   alpha: float = 1.0, layers: tuple[int, ...] | None = None) -> dict:
    """An ``editing`` section of seeded low-rank maps on every head of ``layers`` (all by default), with
    orthonormal rotations (as the lab fits them)."""
    g = torch.Generator().manual_seed(seed)
    width = fingerprint.num_heads * fingerprint.head_dim
    maps = []
    for layer in range(fingerprint.num_layers) if layers is None else layers:
        rotation = torch.linalg.qr(torch.randn(width, rank, generator=g)).Q.T  # [rank, width], orthonormal rows
        maps.append({"layer": layer, "heads": list(range(fingerprint.num_heads)), "alpha": alpha,
                     "rotation": rotation.tolist(), "source_weight": torch.randn(rank, width, generator=g).tolist(),
                     "source_bias": torch.randn(rank, generator=g).tolist()})
    return {"fingerprint": {"num_layers": fingerprint.num_layers, "num_heads": fingerprint.num_heads,
                            "head_dim": fingerprint.head_dim}, "scope": scope, "lowrank": maps}
