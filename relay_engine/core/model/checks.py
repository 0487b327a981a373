"""The serving entry points' input checks: each refusal is a ``ModelInputError`` naming the field
and what is allowed. ``HSTUModel.forward`` (training, probing) runs unchecked."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from relay_engine.core.config import EDIT_SCOPES, EditingConfig
from relay_engine.core.edit_tensors import EditTensors
from relay_engine.core.model.options import ModelConfig
from relay_engine.core.model.values import History, ModelInputError, PrefixKV


def check_history(c: ModelConfig, h: History, name: str, *, allow_empty: bool) -> None:
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


def check_cached_rank(c: ModelConfig, prefix_kv: PrefixKV, short_term: History, *, model_version: str,
                      edit_hash: str, device: torch.device) -> None:
    """That a cached prefix was computed by this model, under the edit in force and on its device,
    and that the short-term tokens can follow it."""
    if prefix_kv.model_version != model_version:
        raise ModelInputError("prefix_kv", f"was computed by model {prefix_kv.model_version}, not {model_version}")
    if prefix_kv.edit_hash != edit_hash:
        raise ModelInputError("prefix_kv", f"was computed under edit {prefix_kv.edit_hash}, "
                                           f"the edit in force is {edit_hash}")
    if prefix_kv.device != device:
        raise ModelInputError("prefix_kv", f"is on {prefix_kv.device}, the model on {device}")
    check_history(c, short_term, "short_term", allow_empty=True)
    if (prefix_kv.timestamps is None) != (short_term.timestamps is None):
        raise ModelInputError("short_term.timestamps", "must be given exactly when the prefix had timestamps")
    if prefix_kv.length + len(short_term) > c.max_seq_len:
        raise ModelInputError("short_term", f"prefix + short-term is {prefix_kv.length + len(short_term)} "
                                            f"tokens; the model takes at most {c.max_seq_len}")


def check_candidates(c: ModelConfig, candidates: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """The candidates as a [C] int64 tensor on device."""
    try:
        cands = torch.as_tensor(candidates)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ModelInputError("candidates", f"must be a list of item ids ({exc})") from None
    if cands.numel() == 0:
        raise ModelInputError("candidates", "is empty; need at least one candidate")
    if cands.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8) or cands.dim() != 1:
        raise ModelInputError("candidates", f"must be a 1-D list of integer item ids, got {cands.dtype} "
                                            f"with {cands.dim()} dims")
    _check_range(cands, "candidates", c.min_item_id, c.num_items - 1)
    return cands.to(device, torch.int64)


def check_editing(c: ModelConfig, editing: EditingConfig) -> None:
    """That a (non-empty) editing section fits this model: its fingerprint, and a scope the model can run."""
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


def check_edit(c: ModelConfig, edit: EditTensors) -> None:
    if edit.num_layers != c.num_layers:
        raise ModelInputError("edit", f"has {edit.num_layers} layers, model has {c.num_layers}")


def _check_range(t: torch.Tensor, name: str, lo: int, hi: int) -> None:
    if t.device.type == "cpu" and not t.requires_grad:
        # numpy's min and max of a short host tensor cost a few µs where torch's two operations cost
        # tens (each a dispatch and an interpreter-lock release): this runs for every pre-infer signal.
        values = t.numpy()
        t_min, t_max = int(values.min()), int(values.max())
    else:
        t_min, t_max = (int(v) for v in torch.aminmax(t))
    if t_min < lo or t_max > hi:
        bad = t_min if t_min < lo else t_max
        raise ModelInputError(name, f"value {bad} out of range [{lo}, {hi}]")
