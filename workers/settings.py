"""Worker fleet settings, all from the environment, in one place.

| variable | default | meaning |
| --- | --- | --- |
| ``REDIS_URL`` | ``redis://127.0.0.1:6379/0`` | Celery broker, result backend and the wire keys |
| ``RELAYGR_KEY_PREFIX`` | ``relaygr`` | prefix of every key and queue (``relay_engine.core.wire``) |
| ``RELAYGR_POOL`` | ``default`` | pool name |
| ``RELAYGR_POOL_SIZE`` | ``1`` | instances in the pool (``python -m workers.pool``) |
| ``RELAYGR_DEVICE`` | ``auto`` | ``auto``, ``cpu``, ``cuda[:N]``, ``npu[:N]`` |
| ``RELAYGR_MODEL`` | ``default`` | a preset of ``MODELS``, or a weights file (``python -m relay_engine.import_gr``) |
| ``RELAYGR_RANK_THREADS`` | ``4`` | Celery threads per instance (ranking runs on them) |
| ``RELAYGR_TORCH_THREADS`` | torch's default | intra-op threads per instance (CPU) |
| ``RELAYGR_HEARTBEAT_INTERVAL_S`` | ``wire.HEARTBEAT_INTERVAL_S`` | status + membership refresh |
| ``RELAYGR_DATA_DIR`` | ``$XDG_STATE_HOME/relaygr`` (``~/.local/state/relaygr``) | local state: each instance's last applied revision (``workers.revision_store``) |
| ``RELAYGR_HISTORY`` | ``redis`` | where telemetry history lives (``wire.HISTORY_TIERS``): ``redis`` writes every tier (1 s, 10 s, 60 s); ``prometheus`` only the live 1 s tier, for a control plane with ``PROMETHEUS_URL`` set |
| ``RELAYGR_CAPTURE_SECRET`` | none: capture off | key of the traffic capture's user hashes (``capture.capture_key``), the same on every instance of a deployment, at least 32 characters; never in Redis. Without it an instance records no traffic and says so in its status (``capture_off``) |

The heartbeat *timeout* is ``wire.HEARTBEAT_TIMEOUT_S`` and not a setting: the control plane judges
liveness with the same constant, and the two sides must agree on who is alive.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relay_engine.core import fields, wire
from relay_engine.core.model import HSTUModel, ModelConfig, WeightsFileError, read_weights

MODELS: dict[str, ModelConfig] = {
    "default": ModelConfig(),
    # Fast to build and to run on a CPU: for tests, demos and the round-trip benchmark.
    "small": ModelConfig(num_items=4096, embed_dim=32, num_layers=2, num_heads=2, head_dim=16,
                         max_seq_len=4096),
}


CAPTURE_SECRET_ENV = "RELAYGR_CAPTURE_SECRET"
MIN_CAPTURE_SECRET_CHARS = 32


class SettingsError(ValueError):
    """An environment variable with a value the fleet cannot use; names the variable."""

    def __init__(self, variable: str, message: str):
        self.variable = variable
        super().__init__(f"{variable}: {message}")


RANK_TRANSPORTS = ("direct", "celery")
PREFILL_PROCESS = ("on", "off")


@dataclass(frozen=True)
class Settings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = wire.DEFAULT_KEY_PREFIX
    pool: str = "default"
    pool_size: int = 1
    device: str = "auto"
    model: str = "default"
    rank_threads: int = 4
    torch_threads: int | None = None
    # How long a Python thread may hold the GIL before another runnable one gets it (CPython's
    # default is 5 ms). A ranking thread that wakes while the pre-inference lane runs Python between
    # torch ops waits up to this long per hand-over; see README "Ranking beside pre-inference".
    gil_switch_ms: float = 1.0
    # On a CPU device, run the instance's prefills on the lane thread ("off") or in a child process of
    # their own ("on"), off the interpreter lock that ranking needs but with a core's worth of its
    # own demand; on 2 cores "off" measured better. See README "How ranking is kept apart".
    prefill_process: str = "off"
    # How the client sends ranking requests: "direct" (a plain Redis list the instance's rank threads
    # take from, ``workers.ranks``) or "celery" (the Celery task, which every instance still serves:
    # senders of the Celery protocol, a rolling upgrade). See README "Ranking beside pre-inference".
    rank_transport: str = "direct"
    heartbeat_interval_s: float = wire.HEARTBEAT_INTERVAL_S
    data_dir: str = ""  # empty: default_data_dir()
    capture_secret: str = field(default="", repr=False)  # empty: the traffic capture is off
    history: str = "redis"  # a key of ``wire.HISTORY_TIERS``

    @property
    def telemetry_tiers(self) -> tuple[str, ...]:
        """The telemetry tiers this instance writes."""
        return wire.HISTORY_TIERS[self.history]

    @property
    def heartbeat_timeout_s(self) -> float:
        return wire.HEARTBEAT_TIMEOUT_S

    @property
    def keys(self) -> wire.PoolKeys:
        return wire.PoolKeys(self.pool, prefix=self.key_prefix)

    def revision_path(self, instance: str) -> str:
        """Where ``instance`` keeps its last applied revision (per key prefix: deployments may share a disk)."""
        return os.path.join(self.data_dir or default_data_dir(os.environ), self.key_prefix, f"{instance}.json")

    @property
    def model_config(self) -> ModelConfig:
        """The preset's config, or the one the weights file records."""
        if self.model in MODELS:
            return MODELS[self.model]
        try:
            return read_weights(self.model)[0]
        except WeightsFileError as exc:
            raise SettingsError("RELAYGR_MODEL", str(exc)) from None

    def build_model(self, device: torch.device) -> HSTUModel:
        """The model to serve on device: a preset (weights from its seed) or the weights file's."""
        if self.model in MODELS:
            return HSTUModel(MODELS[self.model], device)
        try:
            return HSTUModel.load(self.model, device)
        except WeightsFileError as exc:
            raise SettingsError("RELAYGR_MODEL", str(exc)) from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> Settings:
        """Settings from ``env`` (default: os.environ); keyword overrides win (command-line flags)."""
        env = os.environ if env is None else env
        d = cls()
        values = dict(
            redis_url=env.get("REDIS_URL") or d.redis_url,
            key_prefix=env.get(wire.KEY_PREFIX_ENV) or d.key_prefix,
            pool=env.get("RELAYGR_POOL") or d.pool,
            pool_size=_int(env, "RELAYGR_POOL_SIZE", d.pool_size, 1, 1024),
            device=env.get("RELAYGR_DEVICE") or d.device,
            model=env.get("RELAYGR_MODEL") or d.model,
            rank_threads=_int(env, "RELAYGR_RANK_THREADS", d.rank_threads, 1, 256),
            torch_threads=_int(env, "RELAYGR_TORCH_THREADS", None, 1, 1024),
            gil_switch_ms=_float(env, "RELAYGR_GIL_SWITCH_MS", d.gil_switch_ms, 0.1, 100.0),
            prefill_process=env.get("RELAYGR_PREFILL_PROCESS") or d.prefill_process,
            rank_transport=env.get("RELAYGR_RANK_TRANSPORT") or d.rank_transport,
            heartbeat_interval_s=_float(env, "RELAYGR_HEARTBEAT_INTERVAL_S", d.heartbeat_interval_s,
                                        0.05, wire.HEARTBEAT_TIMEOUT_S / 2),
            data_dir=env.get("RELAYGR_DATA_DIR") or d.data_dir,
            capture_secret=env.get(CAPTURE_SECRET_ENV) or d.capture_secret,
            history=env.get("RELAYGR_HISTORY") or d.history,
        )
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        if not wire.NAME_RE.match(self.pool):
            raise SettingsError("RELAYGR_POOL", f"{self.pool!r} is not a pool name ({wire.NAME_RE.pattern})")
        if self.model not in MODELS and not Path(self.model).is_file():
            raise SettingsError("RELAYGR_MODEL", f"{self.model!r} is neither a preset ({', '.join(MODELS)}) nor an "
                                                 f"existing weights file")
        if self.rank_transport not in RANK_TRANSPORTS:
            raise SettingsError("RELAYGR_RANK_TRANSPORT", f"must be one of {', '.join(RANK_TRANSPORTS)}, got "
                                                          f"{self.rank_transport!r}")
        if self.prefill_process not in PREFILL_PROCESS:
            raise SettingsError("RELAYGR_PREFILL_PROCESS", f"must be one of {', '.join(PREFILL_PROCESS)}, got "
                                                           f"{self.prefill_process!r}")
        if self.history not in wire.HISTORY_TIERS:
            raise SettingsError("RELAYGR_HISTORY", f"must be one of {', '.join(wire.HISTORY_TIERS)}, got "
                                                   f"{self.history!r}")
        if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError("REDIS_URL", f"must be a redis:// URL, got {self.redis_url!r}")
        if self.capture_secret and len(self.capture_secret) < MIN_CAPTURE_SECRET_CHARS:
            # Never echoed: it is a secret even when it is a poor one.
            raise SettingsError(CAPTURE_SECRET_ENV, f"must be at least {MIN_CAPTURE_SECRET_CHARS} characters, got "
                                                    f"{len(self.capture_secret)} (e.g. python3 -c 'import secrets; "
                                                    f"print(secrets.token_hex(32))')")

    def worker_env(self) -> dict[str, str]:
        """These settings as environment variables, for a child process (``workers.pool``, tests)."""
        env = {
            "REDIS_URL": self.redis_url, wire.KEY_PREFIX_ENV: self.key_prefix, "RELAYGR_POOL": self.pool,
            "RELAYGR_POOL_SIZE": str(self.pool_size), "RELAYGR_DEVICE": self.device,
            "RELAYGR_MODEL": self.model, "RELAYGR_RANK_THREADS": str(self.rank_threads),
            "RELAYGR_HEARTBEAT_INTERVAL_S": repr(self.heartbeat_interval_s),
            "RELAYGR_GIL_SWITCH_MS": repr(self.gil_switch_ms), "RELAYGR_RANK_TRANSPORT": self.rank_transport,
            "RELAYGR_DATA_DIR": self.data_dir, CAPTURE_SECRET_ENV: self.capture_secret,
            "RELAYGR_HISTORY": self.history, "RELAYGR_PREFILL_PROCESS": self.prefill_process,
        }
        if self.torch_threads is not None:
            env["RELAYGR_TORCH_THREADS"] = str(self.torch_threads)
        return env


def default_data_dir(env: Mapping[str, str]) -> str:
    """The XDG state folder of the user running the worker (a container's home, a service account's)."""
    state_home = env.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(state_home, "relaygr")


def _int(env: Mapping[str, str], name: str, default: int | None, lo: int, hi: int) -> int | None:
    raw = env.get(name)
    if not raw:
        return default
    try:
        return int(fields.number_text(raw, lo, hi, as_int=True))
    except fields.FieldValueError as exc:
        raise SettingsError(name, str(exc)) from None


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name)
    if not raw:
        return default
    try:
        return float(fields.number_text(raw, lo, hi))
    except fields.FieldValueError as exc:
        raise SettingsError(name, str(exc)) from None
