"""How far each forward is from its arithmetic floor: the time its FLOPs take at the device's matmul
peak, or its unavoidable bytes at the device's memory bandwidth, whichever is longer (a roofline).

* **FLOPs** are counted on the real forward by ``torch.utils.flop_counter.FlopCounterMode`` (the
  matmuls: ``addmm``, ``bmm``, ``baddbmm``; pointwise work counts as bytes, not FLOPs).
* **Bytes** are what no implementation can avoid: the prefix KV the forward reads (``rank``) or
  writes (``prefill``), and the layers' weights once. The item-embedding table is not counted (a
  forward reads a few of its rows). A forward whose tensors stay in cache has no byte floor to speak
  of; this one is a lower bound, never an estimate of the traffic.
* **Peak and bandwidth** are measured here, on this device and this thread count, the way a
  micro-benchmark would: the best of a few square float32 GEMMs (``PEAK_GEMM_N``), and the best of a
  few copies of a ``BANDWIDTH_MIB`` tensor (read + write bytes). A ratio of a forward to its floor is
  only as good as these two: they are printed beside it.

``python -m relay_engine.profile --floors`` prints the table (``make profile ARGS="--floors --threads 1"``
for one core).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from relay_engine.core import devices

PEAK_GEMM_N = 1024  # square float32 GEMM the matmul peak is taken from
BANDWIDTH_MIB = 256  # tensor copied to take the memory bandwidth (well past any cache)
ROOFLINE_REPEATS = 5


@dataclass(frozen=True)
class Roofline:
    """What the device does at best: float32 matmul FLOP/s and memory bytes/s, as measured here."""

    matmul_flops_per_s: float
    bytes_per_s: float
    device: str
    threads: int

    def describe(self) -> str:
        return (f"{self.device}, {self.threads} torch thread(s): float32 matmul peak "
                f"{self.matmul_flops_per_s / 1e9:.1f} GFLOP/s (best of {ROOFLINE_REPEATS} {PEAK_GEMM_N}³ GEMMs), "
                f"memory {self.bytes_per_s / 1e9:.1f} GB/s (best of {ROOFLINE_REPEATS} copies of "
                f"{BANDWIDTH_MIB} MiB, read + write)")


def fastest_s(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` (after one warm-up), in wall seconds, the device synchronised."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        devices.synchronize(device)
        t0 = time.perf_counter()
        fn()
        devices.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_roofline(device: torch.device, repeats: int = ROOFLINE_REPEATS) -> Roofline:
    n = PEAK_GEMM_N
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    out = torch.empty(n, n, device=device)
    gemm_s = fastest_s(lambda: torch.mm(a, b, out=out), device, repeats)
    src = torch.empty(BANDWIDTH_MIB * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    copy_s = fastest_s(lambda: dst.copy_(src), device, repeats)
    return Roofline(matmul_flops_per_s=2 * n**3 / gemm_s, bytes_per_s=2 * src.numel() * 4 / copy_s,
                    device=str(device), threads=torch.get_num_threads())


def matmul_flops(fn: Callable[[], object]) -> int:
    """FLOPs of the matmuls one call of ``fn`` runs, counted by torch's own FlopCounterMode."""
    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return int(counter.get_total_flops())


def layer_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights every forward reads whole: all parameters but the item-embedding table."""
    table = getattr(model, "item_emb", None)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not table)


@dataclass(frozen=True)
class FloorRow:
    """One forward beside its floor: the time of its FLOPs at the peak and of its bytes at the bandwidth."""

    op: str
    tokens: int
    flops: int
    nbytes: int
    compute_ms: float
    memory_ms: float
    measured_ms: float

    @property
    def floor_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    @property
    def times_floor(self) -> float:
        return self.measured_ms / self.floor_ms if self.floor_ms > 0 else float("inf")


def floor_row(op: str, tokens: int, fn: Callable[[], object], nbytes: int, roofline: Roofline,
              measured_ms: float) -> FloorRow:
    """``fn`` run once under the FLOP counter; ``nbytes``: what it cannot avoid moving."""
    flops = matmul_flops(fn)
    return FloorRow(op, tokens, flops, nbytes, flops / roofline.matmul_flops_per_s * 1000,
                    nbytes / roofline.bytes_per_s * 1000, measured_ms)


def markdown(rows: list[FloorRow], roofline: Roofline) -> str:
    lines = [f"arithmetic floors: {roofline.describe()}", "",
             "| operation | prefix tokens | MFLOP | floor bytes (MiB) | floor (ms) | bound by | measured (ms) | × floor |",
             "|---|---:|---:|---:|---:|---|---:|---:|"]
    lines += [f"| {r.op} | {r.tokens} | {r.flops / 1e6:.0f} | {r.nbytes / 2**20:.1f} | {r.floor_ms:.2f} "
              f"| {r.bound_by} | {r.measured_ms:.2f} | {r.times_floor:.1f}× |" for r in rows]
    return "\n".join(lines)
