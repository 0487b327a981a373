"""The weights file format: one ``torch.save`` dict, ``{"format", "format_version", "config",
"state_dict", "source"}``, read back with ``weights_only`` (tensors only, no code runs).

``HSTUModel.save`` and ``HSTUModel.load`` are the entry points; this module owns the format, its
checks (each refusal names the file, or the parameter, and what is wrong) and the version that
hashes weights not derived from a seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from pathlib import Path

import torch

from relay_engine.core.model.options import ModelConfig

# What a weights file says it is (``write_weights`` writes it, ``read_weights`` checks it).
WEIGHTS_FORMAT = "relaygr-hstu-weights"
WEIGHTS_FORMAT_VERSION = 1


class WeightsFileError(ValueError):
    """A weights file that cannot be served, naming the file and what is wrong with it."""

    def __init__(self, path: str | Path, message: str):
        self.path = str(path)
        super().__init__(f"{path}: {message}")


def write_weights(path: str | Path, config: ModelConfig, state: Mapping[str, torch.Tensor], *,
                  source: Mapping[str, object] | None = None) -> None:
    """Write the config and the weights (and where they came from) as one file for ``read_weights``."""
    torch.save({"format": WEIGHTS_FORMAT, "format_version": WEIGHTS_FORMAT_VERSION,
                "config": dataclasses.asdict(config),
                "state_dict": {k: v.detach().to("cpu") for k, v in state.items()},
                "source": dict(source or {})}, path)


def read_weights(path: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state_dict) of a weights file written by ``HSTUModel.save``; WeightsFileError naming
    the file and the problem otherwise. Loads tensors only (``weights_only``): no code runs."""
    path = Path(path)
    if not path.is_file():
        raise WeightsFileError(path, "no such file")
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 — any unreadable file is the same answer to the user
        raise WeightsFileError(path, f"not a RelayGR weights file ({type(exc).__name__}: "
                                     f"{str(exc).splitlines()[0][:200] if str(exc) else 'unreadable'})") from None
    if not isinstance(blob, dict) or blob.get("format") != WEIGHTS_FORMAT:
        raise WeightsFileError(path, "not a RelayGR weights file (write one with `python -m relay_engine.import_gr`)")
    if blob.get("format_version") != WEIGHTS_FORMAT_VERSION:
        raise WeightsFileError(path, f"format version {blob.get('format_version')!r}; this build reads "
                                     f"{WEIGHTS_FORMAT_VERSION}")
    config, state = blob.get("config"), blob.get("state_dict")
    if not isinstance(config, dict) or not isinstance(state, dict):
        raise WeightsFileError(path, "has no config or no state_dict")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(config) - known)
    if unknown:
        raise WeightsFileError(path, f"config: unknown field {unknown[0]!r} (written by a newer RelayGR?)")
    try:
        return ModelConfig(**config), state
    except (TypeError, ValueError) as exc:
        raise WeightsFileError(path, f"config.{exc}") from None


def copy_weights(own: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` into a model's own ``state_dict()`` tensors. Raises ValueError naming the first
    parameter missing, unexpected, mis-shaped or not finite."""
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        what = f"missing parameter {missing[0]}" if missing else f"unexpected parameter {unexpected[0]}"
        raise ValueError(f"{what} ({len(missing)} missing, {len(unexpected)} unexpected in all)")
    for name, target in own.items():
        source = state[name]
        if not isinstance(source, torch.Tensor) or not source.is_floating_point():
            raise ValueError(f"{name}: must be a floating-point tensor")
        if tuple(source.shape) != tuple(target.shape):
            raise ValueError(f"{name}: has shape {list(source.shape)}, the config needs {list(target.shape)}")
        if not bool(torch.isfinite(source).all()):
            raise ValueError(f"{name}: has NaN or infinite values")
        with torch.no_grad():
            target.copy_(source)


def weights_version(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> str:
    """A version that hashes the weights themselves, for weights not derived from a seed."""
    h = hashlib.sha256(config.version().encode())
    for name in sorted(state):
        t = state[name].detach().to("cpu", torch.float32).contiguous()
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return "hstu-w" + h.hexdigest()[:12]
