"""Small model configurations and histories shared by the core and lab tests."""

from __future__ import annotations

import torch

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
