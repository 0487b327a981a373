"""Edits in the form the model runs them: per layer, a bias on the head outputs and low-rank maps of
them, built from the ``editing`` section of a policy (``relay_engine.core.config.EditingConfig``).

The section comes from the schema, or from a file through ``editing_io``; this is its tensor side,
kept apart from ``editing_io`` so that the control plane, which reads and writes editing files,
never loads torch. The model checks that an edit fits it (``HSTUModel.edit_from``) and takes the
``EditTensors`` in force as an argument of every operation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from relay_engine.core.config import EditingConfig


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

    @classmethod
    def from_editing(cls, editing: EditingConfig, device: torch.device) -> EditTensors:
        """The tensors of a validated editing section, on device, shaped by its fingerprint (the
        model checks first that the fingerprint and the scope fit it)."""
        fp = editing.fingerprint
        bias_by_layer: list[torch.Tensor | None] = [None] * fp.num_layers
        for e in editing.edits:
            if bias_by_layer[e.layer] is None:
                bias_by_layer[e.layer] = torch.zeros(fp.num_heads, fp.head_dim, device=device)  # [H, D]
            bias_by_layer[e.layer][e.head] += e.alpha * torch.tensor(e.direction, dtype=torch.float32,
                                                                     device=device)
        maps_by_layer: list[list[LowRankMap]] = [[] for _ in range(fp.num_layers)]

        def tensor(values: tuple) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        for m in editing.lowrank:
            maps_by_layer[m.layer].append(LowRankMap.from_parts(
                torch.tensor(m.heads, dtype=torch.int64, device=device), tensor(m.rotation),
                tensor(m.source_weight), tensor(m.source_bias), m.alpha))
        return cls(tuple(bias_by_layer), tuple(tuple(maps) for maps in maps_by_layer), editing.scope,
                   editing.content_hash())

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
