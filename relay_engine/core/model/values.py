"""The values the model takes and returns: token runs (``History``), a pre-inferred prefix's per-layer
K/V (``PrefixKV``, what the cache tiers hold), and the error that names a bad input by field."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch


class ModelInputError(ValueError):
    """Bad input to the model, naming the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


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
            elif t.device.type == "cpu" and t.dtype == torch.int64 and t.is_contiguous() and not t.requires_grad:
                h.update(t.numpy())  # the same bytes, without three copies (every pre-infer signal takes one)
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
