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

* **The GEMMs at their shapes**: every matmul the forward runs is recorded (``TorchDispatchMode``)
  and replayed alone, on fresh operands of the same sizes and strides, warm, the fastest of a few.
  Their sum is what this GEMM library does for these shapes at best; the forward's time beyond it
  is everything else (pointwise passes, copies, dispatch). It splits the distance to the floor in
  two: the GEMMs' own distance from the 1024³ peak (attention's inner dimension is ``head_dim``, far
  too short for it), and the rest.

``python -m relay_engine.profile --floors`` prints the table (``make profile ARGS="--floors --threads 1"``
for one core).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
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


_GEMMS = frozenset({torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_, torch.ops.aten.bmm,
                    torch.ops.aten.baddbmm, torch.ops.aten.baddbmm_})


@dataclass(frozen=True)
class GemmCall:
    """One matmul of a forward: its op and its arguments, tensors kept as (size, stride)."""

    op: object  # an aten OpOverload
    args: tuple
    kwargs: dict

    def replay(self, device: torch.device) -> Callable[[], object]:
        """The same call on fresh operands of the same layouts (random values: a GEMM's time does not
        depend on them, but zeros could hit a shortcut)."""
        def fresh(a):
            if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], torch.Size):
                return torch.empty_strided(a[0], a[1], device=device).normal_()
            return a
        args, kwargs = tuple(map(fresh, self.args)), {k: fresh(v) for k, v in self.kwargs.items()}
        return lambda: self.op(*args, **kwargs)


class _GemmRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in _GEMMS:
            def layout(a):
                return (a.size(), a.stride()) if isinstance(a, torch.Tensor) else a
            self.calls.append(GemmCall(func, tuple(map(layout, args)), {k: layout(v) for k, v in kwargs.items()}))
        return func(*args, **kwargs)


def gemm_calls(fn: Callable[[], object]) -> list[GemmCall]:
    """Every matmul one call of ``fn`` runs, in order."""
    recorder = _GemmRecorder()
    with recorder:
        fn()
    return recorder.calls


def gemms_alone_ms(calls: list[GemmCall], device: torch.device, repeats: int = ROOFLINE_REPEATS) -> float:
    """The forward's matmuls, each run alone and warm at its own shape (the fastest of ``repeats``), summed."""
    return sum(fastest_s(call.replay(device), device, repeats) for call in calls) * 1000


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
    gemms_ms: float  # the forward's matmuls alone at their shapes (``gemms_alone_ms``)

    @property
    def floor_ms(self) -> float:
        return max(self.compute_ms, self.memory_ms)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_ms >= self.memory_ms else "memory"

    @property
    def times_floor(self) -> float:
        return self.measured_ms / self.floor_ms if self.floor_ms > 0 else float("inf")

    @property
    def gemms_times_floor(self) -> float:
        return self.gemms_ms / self.floor_ms if self.floor_ms > 0 else float("inf")


def floor_row(op: str, tokens: int, fn: Callable[[], object], nbytes: int, roofline: Roofline,
              measured_ms: float, device: torch.device | None = None) -> FloorRow:
    """``fn`` run once under the FLOP counter and once recording its matmuls, which are then timed
    alone; ``nbytes``: what it cannot avoid moving."""
    flops = matmul_flops(fn)
    gemms_ms = gemms_alone_ms(gemm_calls(fn), device or torch.device(roofline.device))
    return FloorRow(op, tokens, flops, nbytes, flops / roofline.matmul_flops_per_s * 1000,
                    nbytes / roofline.bytes_per_s * 1000, measured_ms, gemms_ms)


def markdown(rows: list[FloorRow], roofline: Roofline) -> str:
    lines = [f"arithmetic floors: {roofline.describe()}", "",
             "| operation | prefix tokens | MFLOP | floor bytes (MiB) | floor (ms) | bound by "
             "| GEMMs alone (ms) | × floor | measured (ms) | × floor | GEMMs' share |",
             "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r.op} | {r.tokens} | {r.flops / 1e6:.0f} | {r.nbytes / 2**20:.1f} | {r.floor_ms:.2f} "
              f"| {r.bound_by} | {r.gemms_ms:.2f} | {r.gemms_times_floor:.1f}× | {r.measured_ms:.2f} "
              f"| {r.times_floor:.1f}× | {r.gemms_ms / r.measured_ms:.0%} |" for r in rows]
    lines += ["", "GEMMs alone: the forward's matmuls replayed one by one at their own shapes, warm (the best "
              "this library does for them); the rest of the measured time is pointwise passes, copies and dispatch."]
    return "\n".join(lines)
