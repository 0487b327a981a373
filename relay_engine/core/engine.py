"""One RelayGR instance: a model on a device, its cache tier stack, the trigger and the policy.

``submit_pre_infer`` runs when the retrieval stage sends its signal: the trigger decides at once,
and an admitted prefill runs on the engine's pre-inference lane (its own thread and compute share,
``lane.PreInferLane``), never on a ranking thread; ``pre_infer`` does the same in the calling
thread. ``rank`` tens of milliseconds later asks the tier stack (``tiers.TierStack``, which owns the
order): the HBM entry; a pre-inference or recompute already in flight for the same key (joined, not
repeated — unless it would finish too late: a rank that would wait past the point where a recompute
could still meet its deadline recomputes instead); an entry of a lower tier (DRAM, then disk when the
policy names one) promoted back to HBM, one reload shared by concurrent ranks; or a recompute (a miss,
whose prefix KV is then kept for the user's next request when the budget allows). Each rank is
counted once, in the counter of its ``Outcome``; each miss also once under its ``MissReason``, under
the same lock, so misses by reason always sum to the misses: the tier stack's ledger
(``miss_ledger``) says why the key is gone; a join that failed, or one abandoned as too late, is
said here; ``set_rerouted_check`` tells the engine which users a membership change moved here.

Thread-safe. ``apply_policy`` swaps one immutable state object; each request reads that reference
once at its start, so a policy applies between requests, never halfway through one.

Two seams make the same policy code run on a virtual clock (the fleet simulator): ``clock`` /
``wall_clock``, and ``forwards`` (the forward passes: the model, or a cost model) with ``waiter``
(how a request waits for a computation in flight) and ``preinfer_lane``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from relay_engine.core import devices
from relay_engine.core.config import PolicySpec, default_policy
from relay_engine.core.features import EventDedup
from relay_engine.core.forward_times import ForwardTimes, TimedForwards, clock_for
from relay_engine.core.kvcache import CacheKey, HBMCache
from relay_engine.core.lane import Lane, PreInferLane, ShareAccount, SharePacer, YieldEveryOp, nice_for_share
from relay_engine.core.model import EditTensors, History, HSTUModel, ModelConfig, ModelInputError, PrefixKV
from relay_engine.core.outcomes import OUTCOME_COUNTERS, Outcome
from relay_engine.core.prefill_process import PrefillProcess, PrefillProcessError, ProcessPrefillForwards
from relay_engine.core.telemetry import (
    COUNTERS,
    LOWER_TIER_EVICTIONS,
    MISS_REASONS,
    NOT_ADMITTED,
    REFUSAL_REASONS,
    TIER_LEVELS,
    LatencyHistogram,
    MissReason,
    RefusalReason,
)
from relay_engine.core.tiers import TierFigures, TierSite, TierStack, build_lower_tiers, lower_tiers_problem
from relay_engine.core.trigger import CacheFootprint, RankingLoad, SequenceAwareTrigger

log = logging.getLogger(__name__)

# The miss reason of every ranking request under a policy without a cache (``cache.enabled`` false): no
# prefix was pre-inferred or kept for it, as with pre-inference turned off.
CACHE_OFF = NOT_ADMITTED[RefusalReason.DISABLED]


class DeadlineExceeded(Exception):
    """A ranking request whose deadline passed before its scores were ready."""


class PolicyApplyError(ValueError):
    """A policy that is valid by the schema but cannot be applied on this instance."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class Forwards(Protocol):
    """The forward passes the engine runs: ``HSTUModel`` itself, or a cost model on a virtual clock."""

    def prefill(self, prefix: History, edit: EditTensors | None = None, *,
                between_layers: Callable[[], None] | None = None) -> PrefixKV: ...

    def rank(self, prefix_kv: PrefixKV, short_term: History, candidates: torch.Tensor,
             query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor: ...

    def rank_full(self, prefix: History, short_term: History, candidates: torch.Tensor,
                  query_timestamp: int | None = None, edit: EditTensors | None = None) -> torch.Tensor: ...

    def rank_full_keeping_prefix(self, prefix: History, short_term: History, candidates: torch.Tensor,
                                 query_timestamp: int | None = None,
                                 edit: EditTensors | None = None) -> tuple[torch.Tensor, PrefixKV]: ...


Waiter = Callable[[Future, "float | None"], Any]


def wait_for_future(future: Future, timeout_s: float | None) -> Any:
    """The real waiter: block this thread (FutureTimeout after timeout_s)."""
    return future.result(timeout=timeout_s)


@dataclass(frozen=True)
class PreInferRequest:
    user_id: str
    prefix: History


@dataclass(frozen=True)
class RankRequest:
    user_id: str
    prefix: History
    short_term: History
    candidates: Sequence[int] | torch.Tensor
    deadline_s: float | None = None  # wall-clock (time.time()) instant after which the answer is useless
    query_timestamp: int | None = None


@dataclass(frozen=True)
class PreInferResult:
    admitted: bool
    reason: str | None
    prefix_len: int
    nbytes: int = 0
    elapsed_ms: float = 0.0


@dataclass(frozen=True)
class RankResult:
    scores: list[float]
    source: Outcome
    prefix_len: int
    latency_ms: float
    miss_reason: MissReason | None = None  # why the prefix was in no tier; None unless source is a miss


@dataclass
class EngineStats:
    name: str
    device: str
    model_version: str
    policy_sha256: str
    edit_hash: str
    counters: dict[str, int]
    refusals: dict[str, int]
    rank_latency: LatencyHistogram
    hbm_bytes: int
    hbm_budget_bytes: int
    hbm_peak_bytes: int
    hbm_entries: int
    device_allocated_bytes: int | None = None
    tiers: dict[str, TierFigures] = field(default_factory=dict)  # every tier's figures, by name, in lookup order
    misses: dict[str, int] = field(default_factory=dict)  # by ``MISS_REASONS``; they sum to counters["misses"]

    def tier_levels(self) -> dict[str, dict[str, int]]:
        """Each tier's levels (``telemetry.TIER_LEVELS``) by name, in lookup order: what the status carries."""
        return {name: {level: getattr(figures, level) for level in TIER_LEVELS} for name, figures in self.tiers.items()}


@dataclass(frozen=True)
class _State:
    policy: PolicySpec
    edit: EditTensors
    slo_ms: float

    @functools.cached_property
    def canonical(self) -> EventDedup | None:
        """The canonicalisation the policy asks for (``features``), applied to every history before its
        cache key is taken and the model sees it; None: off."""
        within = self.policy.features.dedup_events_within_s
        return None if within is None else EventDedup(within)

    def canonicalised(self, history: History) -> History:
        return history if self.canonical is None else self.canonical.apply(history)


@dataclass(frozen=True)
class _Admission:
    """An admitted pre-inference: its key is reserved in HBM and registered as producing."""

    key: CacheKey
    prefix: History
    state: _State  # the policy and edit it was admitted under


class _TooLate(Exception):
    """The computation in flight would finish past the point where a recompute could still be on time."""


class RankingGate:
    """Where pre-inference yields to ranking: every yield point of a pre-inference thread — between a
    prefill's layers and steps (``HSTUModel.prefill``'s ``between_layers``), before each torch
    operation of a prefill on the lane (``lane.YieldEveryOp``), between pre-infer signals — is a
    ``lane.SharePacer`` call that waits while requests are being ranked on this instance, once the
    thread has had its compute share of the busy period (see there).

    Ranking counts from the moment a rank thread takes a request to its answer (``running``), not only
    the engine's forward: payload parsing, features and the reply hold the same interpreter lock.
    One process shares one lock, so each time a paced thread resumes, the rank thread waits for it; on
    a quiet 2-core machine under a steady pre-inference backlog, a rank saw 16 such waits and 2.5–3×
    its P99 with the prefill paced only between steps (``bench_roundtrip``). Counted per thread: a
    rank that nests (the request, then the engine) counts once, and one that waits for a prefix being
    computed steps out (``stepped_out``) so that computation is not paused for it. Real time
    throughout: this paces real compute (the simulator models the share directly)."""

    def __init__(self, mirror: Any = None, clock: Callable[[], float] = time.perf_counter) -> None:
        self._active = 0
        self._busy_since = 0.0  # when the current busy period began (``clock``), while one is under way
        self._clock = clock
        self._idle = threading.Condition()
        self._depth = threading.local()
        self._mirror = mirror  # a shared counter a prefill process reads (``prefill_process``), or None
        self._account: ShareAccount | None = None  # the credit this instance's pre-inference threads share
        self._account_lock = threading.Lock()

    def _add(self, n: int) -> None:
        with self._idle:
            if not self._active:
                self._busy_since = self._clock()
            self._active += n
            if self._mirror is not None:
                self._mirror.value = self._active
            if not self._active:
                self._idle.notify_all()

    def enter(self) -> None:
        depth = getattr(self._depth, "n", 0)
        self._depth.n = depth + 1
        if depth == 0:
            self._add(1)

    def leave(self) -> None:
        self._depth.n -= 1
        if self._depth.n == 0:
            self._add(-1)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """This thread ranks for the block's duration."""
        self.enter()
        try:
            yield
        finally:
            self.leave()

    @contextlib.contextmanager
    def stepped_out(self) -> Iterator[None]:
        """This thread does not rank for the block's duration, however deeply it had entered."""
        depth = getattr(self._depth, "n", 0)
        self._depth.n = 0
        if depth:
            self._add(-1)
        try:
            yield
        finally:
            self._depth.n = depth
            if depth:
                self._add(1)

    @property
    def active(self) -> int:
        """How many threads are ranking now."""
        return self._active

    def ranking(self) -> bool:
        return self._active > 0

    def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until nothing ranks (True) or ``timeout_s`` passes (False)."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._active, timeout=timeout_s)

    def pacer(self, share: float, *, cpu: Callable[[], float] = time.thread_time) -> SharePacer:
        """The yield points of one pre-inference thread at the given compute share, made on that
        thread (``cpu``: the clock of its compute, the calling thread's CPU time by default; wall time
        is the gate's clock). Every pacer of the gate draws on one account, so the instance's
        pre-inference as a whole (the lane's prefills and the signal reader) gets ``share``, not each
        thread; a new share starts a new account."""
        with self._account_lock:
            if self._account is None or self._account.share != share:
                self._account = ShareAccount(share, now_s=self._clock())
            account = self._account
        return SharePacer(share, self.ranking, self.wait_idle, wall=self._clock, cpu=cpu,
                          busy_since=lambda: self._busy_since, account=account)


class RelayEngine:
    def __init__(self, model_config: ModelConfig | None = None, *, device: str | torch.device | None = None,
                 policy: PolicySpec | None = None, name: str = "engine", model: HSTUModel | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time,
                 forwards: Forwards | None = None, waiter: Waiter = wait_for_future,
                 preinfer_lane: Lane | None = None, prefill_process: bool = False):
        self.name = name
        self.device = device if isinstance(device, torch.device) else devices.select_device(device)
        self.model = model if model is not None else HSTUModel(model_config, self.device)
        if self.model.device != self.device:
            raise ValueError(f"model is on {self.model.device}, engine on {self.device}")
        self.clock, self.wall_clock = clock, wall_clock
        # The real model's passes are timed into ``forward_times`` (cumulative; what the pool's cost model
        # is fitted from); a cost model's, on a virtual clock, are not (``forward_clock`` "none").
        self.forward_times = ForwardTimes()
        self.forward_clock = "none"
        if forwards is None:
            timer, self.forward_clock = clock_for(self.device)
            forwards = TimedForwards(self.model, self.forward_times, timer)
        policy = policy or default_policy()
        # On the CPU, prefills may run in a child process (``prefill_process``): off the interpreter
        # lock ranking needs, at the lane's share as the child's nice value.
        self._prefill_process: PrefillProcess | None = None
        if prefill_process and self.device.type == "cpu" and isinstance(forwards, TimedForwards):
            try:
                self._prefill_process = PrefillProcess(self.model, name=f"{name}-prefill",
                                                       share=policy.trigger.preinfer_compute_share)
            except PrefillProcessError as exc:
                log.warning("%s: prefills stay on the lane thread: %s", name, exc)
        if self._prefill_process is not None:
            forwards = ProcessPrefillForwards(forwards, self._prefill_process, self.forward_times)
            # The child yields to ranking at its yield points as the lane thread does: it reads this gate.
            self.ranking_gate = RankingGate(mirror=self._prefill_process.ranking_active)
        else:
            self.ranking_gate = RankingGate()
        self._yielding = threading.local()  # each outside thread's pacer (``yield_to_ranking``)
        self.forwards: Forwards = forwards
        self._wait = waiter
        self._lane: Lane = preinfer_lane if preinfer_lane is not None else \
            PreInferLane(self.device, policy.trigger.preinfer_compute_share, name=f"{name}-preinfer")
        self.ranking_load = RankingLoad()
        self._tier_site = TierSite(name, self.device, clock)
        self._check_applicable(policy)
        self.cache = TierStack(HBMCache(policy.cache.hbm_budget_bytes, policy.cache.entry_ttl_ms / 1000, clock=clock),
                               build_lower_tiers(policy.cache, self._tier_site, ()), self.device)
        self.trigger = SequenceAwareTrigger(policy.trigger, now_s=clock())
        self._admit_lock = threading.Lock()  # trigger decision + reservation are one step
        self._counters: Counter[str] = Counter()
        self._misses: Counter[str] = Counter()  # by reason, under the counter lock with the misses
        self._counter_lock = threading.Lock()
        self._rerouted: tuple[Callable[[str], bool], float] | None = None
        self._rank_latency = LatencyHistogram()
        self._apply_lock = threading.Lock()
        self._last_expiry = clock()
        edit = self.model.edit_from(policy.editing)
        self._state = _State(policy, edit, policy.trigger.ranking_p99_slo_ms)

    # --- policy ------------------------------------------------------------------------------

    @property
    def prefill_where(self) -> str:
        """Where admitted prefills run, in words (the instance's start-up line says it)."""
        process = self._prefill_process
        return "on the lane thread" if process is None else f"in a child process (pid {process.pid})"

    @property
    def policy(self) -> PolicySpec:
        return self._state.policy

    @property
    def edit(self) -> EditTensors:
        """The edit in force (the engine is its one owner; the model holds none)."""
        return self._state.edit

    def _check_applicable(self, policy: PolicySpec) -> None:
        device_bytes = devices.device_memory_bytes(self.device)
        limit, where = (device_bytes, f"{self.device}'s memory") if device_bytes else \
            (devices.host_memory_bytes(), "host memory (the CPU device's HBM tier lives there)")
        if policy.cache.hbm_budget_bytes > limit:
            raise PolicyApplyError("cache.hbm_budget_mb", f"{policy.cache.hbm_budget_mb:.10g} MiB exceeds {where}, "
                                                          f"{limit / 2**20:.0f} MiB")
        problem = lower_tiers_problem(policy.cache)
        if problem is not None:
            raise PolicyApplyError(*problem)

    def apply_policy(self, policy: PolicySpec) -> None:
        """Apply a validated policy atomically, or raise PolicyApplyError and keep the current one."""
        self._check_applicable(policy)
        try:
            edit = self.model.edit_from(policy.editing)
        except ModelInputError as exc:
            raise PolicyApplyError(exc.field, str(exc).split(": ", 1)[-1]) from None
        with self._apply_lock:
            old = self._state
            self.trigger.update_policy(policy.trigger)
            self._lane.set_share(policy.trigger.preinfer_compute_share)
            if self._prefill_process is not None:
                self._prefill_process.set_share(policy.trigger.preinfer_compute_share)
            self.cache.hbm.resize(policy.cache.hbm_budget_bytes, policy.cache.entry_ttl_ms / 1000)
            self.cache.set_lower(build_lower_tiers(policy.cache, self._tier_site, self.cache.tiers[1:]))
            if not policy.cache.enabled:  # off: what the tiers hold could never be read, free it now
                self.cache.clear(CACHE_OFF)
            if edit.content_hash != old.edit.content_hash:
                # Keys carry the edit hash, so old entries could never be read again: free them now.
                self.cache.clear(MissReason.EDIT_CHANGED)
            self._state = _State(policy, edit, policy.trigger.ranking_p99_slo_ms)

    def set_rerouted_check(self, was_elsewhere: Callable[[str], bool] | None) -> None:
        """The membership changed (the worker knows it; the engine does not): ``was_elsewhere(user_id)``
        says whether the previous membership routed that user to another instance. A miss of a user
        this engine has not seen is then counted rerouted, while an entry made before the change could
        still live (the longest TTL of the tiers); after that, or with None, a first visit."""
        self._rerouted = None if was_elsewhere is None else (was_elsewhere, self.clock())

    def _was_rerouted(self, user_id: str) -> bool:
        rerouted = self._rerouted
        if rerouted is None:
            return False
        was_elsewhere, since = rerouted
        return self.clock() - since <= self.cache.max_ttl_s and was_elsewhere(user_id)

    # --- requests ----------------------------------------------------------------------------

    def cache_key(self, user_id: str, prefix: History, edit: EditTensors | None = None) -> CacheKey:
        edit = edit or self._state.edit
        return CacheKey(str(user_id), prefix.digest(), self.model.version, edit.content_hash)

    def pre_infer(self, request: PreInferRequest) -> PreInferResult:
        """Pre-infer the long-term prefix if the trigger admits it, in the calling thread."""
        admission = self._admit(request)
        if isinstance(admission, PreInferResult):
            return admission
        return self._produce(admission)

    def yield_to_ranking(self) -> None:
        """A yield point for a pre-inference thread other than the lane (the instance's signal reader):
        paced at the policy's compute share, on the same account as the lane's prefills
        (``RankingGate``), and at the lane's CPU priority. At nice 0 the signal reader was the thread
        that most often took a rank thread's core from it (``perf sched`` under bench_roundtrip's
        steady backlog: ~1,800 of ~4,000 preemptions of rank threads in 4 s, before Redis and the
        lane), each time it woke to read or to yield."""
        share = self._state.policy.trigger.preinfer_compute_share
        pacer = getattr(self._yielding, "pacer", None)
        if pacer is None or pacer.share != share:
            # A larger share is a lower nice, which an unprivileged thread cannot take: logged, kept.
            devices.lower_thread_priority(nice_for_share(share), f"{self.name}: pre-infer signals")
            pacer = self._yielding.pacer = self.ranking_gate.pacer(share)
        pacer()

    def submit_pre_infer(self, request: PreInferRequest) -> PreInferResult:
        """Decide now; an admitted prefill runs on the pre-inference lane (its own thread and compute
        share), and a ranking request that arrives meanwhile joins it. Returns the decision."""
        admission = self._admit(request)
        if isinstance(admission, PreInferResult):
            return admission
        self._lane.submit(lambda: self._produce(admission))
        return PreInferResult(True, None, len(admission.prefix), self.model.prefix_nbytes(
            len(admission.prefix), admission.prefix.timestamps is not None))

    def close(self) -> None:
        """Finish the queued pre-inferences, stop the lane's thread and close the tiers."""
        self._lane.close()
        if self._prefill_process is not None:
            self._prefill_process.close()
        self.cache.close()

    def _admit(self, request: PreInferRequest) -> _Admission | PreInferResult:
        """The trigger's decision; an admission reserves the bytes and registers the key as producing."""
        state = self._state
        self.model.check_history(request.prefix, "prefix", allow_empty=False)
        prefix = state.canonicalised(request.prefix)
        self._count("preinfer_signals")
        self._maybe_expire()
        key = self.cache_key(request.user_id, prefix, state.edit)
        nbytes = self.model.prefix_nbytes(len(prefix), prefix.timestamps is not None)
        now = self.clock()
        ranking_wait_ms = self.ranking_load.tail_wait_ms(now)
        with self._admit_lock:
            decision = self.trigger.decide(
                len(prefix), already_cached=self.cache.holds(key), inflight=len(self.cache.producing),
                footprint=CacheFootprint(nbytes, self.cache.pinned_bytes, self.cache.hbm.budget_bytes),
                now_s=now, ranking_wait_ms=ranking_wait_ms,
            )
            if decision.admit and not self.cache.reserve(key, nbytes):
                decision = self.trigger.overrule(RefusalReason.CACHE_BUDGET)
            if decision.admit:
                self.cache.producing.begin(key)
        if not decision.admit:
            if decision.reason.is_refusal:
                self.cache.ledger.lost([key], NOT_ADMITTED[decision.reason])
            return PreInferResult(False, decision.reason, len(prefix))
        self._count("preinfer_admitted")
        return _Admission(key, prefix, state)

    def _produce(self, admission: _Admission) -> PreInferResult:
        key = admission.key
        t0 = self.clock()
        state = admission.state
        pace = self.ranking_gate.pacer(state.policy.trigger.preinfer_compute_share)
        try:
            with YieldEveryOp(pace, self.ranking_gate.ranking):
                kv = self.forwards.prefill(admission.prefix, state.edit, between_layers=pace)
            devices.synchronize_current_stream(self.device)  # ranking reads it from another stream
        except BaseException as exc:
            self.cache.abort(key)
            self.cache.ledger.lost([key], MissReason.FAILED)
            self.cache.producing.finish(key, error=exc)
            raise
        if not self._keep_if_edit_in_force(state, lambda: self.cache.commit(key, kv)):
            self.cache.abort(key)  # the edit changed while it ran: no request could read it, so hold nothing
            self.cache.ledger.lost([key], MissReason.EDIT_CHANGED)
            self._count("preinfer_stale_edit")
        self.cache.producing.finish(key, kv)
        self._count("preinfer_completed")
        return PreInferResult(True, None, len(admission.prefix), kv.nbytes, (self.clock() - t0) * 1000)

    def rank(self, request: RankRequest) -> RankResult:
        """Score the candidates, from the cached prefix when there is one. Raises DeadlineExceeded
        when the deadline passes first, ModelInputError on bad input."""
        t0 = self.clock()
        state = self._state
        self._count("rank_requests")
        self.ranking_gate.enter()
        try:
            self._check_deadline(request, "on arrival")
            m = self.model
            m.check_history(request.prefix, "prefix", allow_empty=False)
            m.check_history(request.short_term, "short_term", allow_empty=True)
            if len(request.prefix) + len(request.short_term) > m.config.max_seq_len:
                raise ModelInputError("short_term", f"prefix + short-term is "
                                      f"{len(request.prefix) + len(request.short_term)} tokens; "
                                      f"the model takes at most {m.config.max_seq_len}")
            candidates = m.check_candidates(request.candidates)
            if state.canonical is not None:
                request = dataclasses.replace(request, prefix=state.canonicalised(request.prefix),
                                              short_term=state.canonicalised(request.short_term))
            if not state.policy.cache.enabled:  # no cache: nothing looked up, nothing kept
                source, miss_reason = Outcome.MISS, CACHE_OFF
                self._count_miss(miss_reason)
                scores = self.forwards.rank_full(request.prefix, request.short_term, candidates,
                                                 request.query_timestamp, state.edit)
            else:
                scores, source, miss_reason = self._cached_scores(request, candidates, state)
            result = scores.tolist()
            self._check_deadline(request, "after scoring")
        except DeadlineExceeded:
            self._count("rank_deadline_exceeded")
            self._count("rank_errors")
            raise
        except BaseException:
            self._count("rank_errors")
            raise
        finally:
            self.ranking_gate.leave()
            self.ranking_load.record(t0, self.clock())
        latency_ms = (self.clock() - t0) * 1000
        with self._counter_lock:
            self._rank_latency.record(latency_ms)
            self._counters["rank_ok"] += 1
            if latency_ms <= state.slo_ms:
                self._counters["rank_within_slo"] += 1
        return RankResult(result, source, len(request.prefix), latency_ms, miss_reason)

    def _cached_scores(self, request: RankRequest, candidates: torch.Tensor,
                       state: _State) -> tuple[torch.Tensor, Outcome, MissReason | None]:
        """The scores from the prefix the tier stack has (or one computation in flight), else a full
        forward whose prefix KV is kept; with where the prefix came from and a miss's reason."""
        miss_reason = None
        try:
            kv, source, join_failed = self._prefix_kv(request, state)
        except _TooLate:  # the computation in flight would finish too late: recompute alone
            kv, source, miss_reason = None, Outcome.MISS, MissReason.TOO_LATE
            self._count_miss(miss_reason)
            scores = self.forwards.rank_full(request.prefix, request.short_term, candidates,
                                             request.query_timestamp, state.edit)
        else:
            if kv is None:  # a miss: one full forward gives the scores and the prefix KV to keep
                scores, source, miss_reason = self._recompute(request, candidates, state, join_failed)
            else:
                self._check_deadline(request, f"after fetching the prefix cache ({source})")
                scores = self.forwards.rank(kv, request.short_term, candidates, request.query_timestamp,
                                            state.edit)
        return scores, source, miss_reason

    def _prefix_kv(self, request: RankRequest, state: _State) -> tuple[PrefixKV | None, Outcome, bool]:
        """The prefix KV from the tier stack, where it came from (counted; a miss is counted by
        ``_recompute``) and whether a computation it joined failed. Raises _TooLate when the
        computation in flight would finish too late."""
        key = self.cache_key(request.user_id, request.prefix, state.edit)
        join_failed = False

        def join(running: Future) -> PrefixKV | None:
            nonlocal join_failed
            kv = self._join_inflight(request, running, state)
            join_failed = kv is None
            return kv

        try:
            found = self.cache.lookup(key, join=join, timeout_s=self._remaining_s(request))
        except FutureTimeout:
            raise DeadlineExceeded(self._late_message(request, "waiting for a reload in flight")) from None
        if found.found:
            self._count_outcome(found.outcome)
        return found.kv, found.outcome, join_failed

    def _join_inflight(self, request: RankRequest, running: Future, state: _State) -> PrefixKV | None:
        """Wait for a pre-inference (or another request's recompute) of the key already running.

        Waits only while a recompute could still meet the deadline (remaining time minus the latency
        model's full inference): past that, raises _TooLate — recomputing now is the better bet than a
        prefill that may be queued or starved. None when that computation failed. When even a
        recompute would be late, waits to the deadline and raises DeadlineExceeded."""
        remaining_s = self._remaining_s(request)
        limit_s = remaining_s
        full_ms = state.policy.trigger.predicted_full_ms(len(request.prefix))
        if remaining_s is not None and full_ms is not None and remaining_s > full_ms / 1000:
            limit_s = remaining_s - full_ms / 1000
        try:
            with self.ranking_gate.stepped_out():  # waiting for that computation is not competing with it
                return self._wait(running, limit_s)
        except FutureTimeout:
            if limit_s != remaining_s:
                raise _TooLate from None
            raise DeadlineExceeded(self._late_message(request, "waiting for the prefix computation in flight")) \
                from None
        except Exception:  # noqa: BLE001 — that computation failed; this request computes its own
            return None

    def _recompute(self, request: RankRequest, candidates: torch.Tensor, state: _State,
                   join_failed: bool) -> tuple[torch.Tensor, Outcome, MissReason | None]:
        """A miss: rank with a full forward and keep the prefix KV it computed for the next request.
        Concurrent requests for the same key wait for this one's KV instead of recomputing it. Returns
        the scores, where the prefix came from (a miss for the one that computed it) and, for a miss,
        its reason (``join_failed``: the lookup's join of a computation in flight got nothing)."""
        key = self.cache_key(request.user_id, request.prefix, state.edit)
        future, leader = self.cache.producing.begin(key)
        if not leader:
            try:
                kv = self._join_inflight(request, future, state)
            except _TooLate:
                kv, reason = None, MissReason.TOO_LATE
            else:
                reason = MissReason.FAILED
            if kv is not None:
                self._count_outcome(Outcome.INFLIGHT)
                return self.forwards.rank(kv, request.short_term, candidates, request.query_timestamp,
                                          state.edit), Outcome.INFLIGHT, None
        else:
            # The lookup that sent this request here ran before ``begin``: a computation of the key may
            # have started *and* finished in between (this thread descheduled), leaving its KV in HBM.
            # Looked up again under leadership, that KV is found, never computed a second time.
            found = self.cache.lookup(key)
            if found.found:
                self.cache.producing.finish(key, found.kv)
                self._count_outcome(found.outcome)
                return self.forwards.rank(found.kv, request.short_term, candidates, request.query_timestamp,
                                          state.edit), found.outcome, None
            reason = self.cache.ledger.decide(key, self._was_rerouted)
            if join_failed:
                reason = MissReason.FAILED
        self._count_miss(reason)
        try:
            scores, kv = self.forwards.rank_full_keeping_prefix(request.prefix, request.short_term, candidates,
                                                                request.query_timestamp, state.edit)
        except BaseException as exc:
            if leader:
                self.cache.producing.finish(key, error=exc)
            raise
        if leader:
            if not self._keep_if_edit_in_force(state, lambda: self.cache.insert(key, kv, consumed=True)):
                self.cache.ledger.lost([key], MissReason.EDIT_CHANGED)
            self.cache.producing.finish(key, kv)
        return scores, Outcome.MISS, reason

    def _keep_if_edit_in_force(self, state: _State, keep: Callable[[], object]) -> bool:
        """Run ``keep`` (a commit or insert of a KV computed under ``state``) only if that state's
        edit is still in force, atomically with ``apply_policy``: keys carry the edit hash, so an
        entry kept under a replaced edit is one no request can reach. False when it was not kept."""
        with self._apply_lock:
            if self._state.edit.content_hash != state.edit.content_hash:
                return False
            keep()
            return True

    # --- helpers -----------------------------------------------------------------------------

    def _remaining_s(self, request: RankRequest) -> float | None:
        if request.deadline_s is None:
            return None
        return max(0.0, request.deadline_s - self.wall_clock())

    def _late_message(self, request: RankRequest, stage: str) -> str:
        late_ms = (self.wall_clock() - request.deadline_s) * 1000 if request.deadline_s else 0.0
        return f"rank for user {request.user_id!r} missed its deadline by {max(0.0, late_ms):.1f} ms ({stage})"

    def _check_deadline(self, request: RankRequest, stage: str) -> None:
        if request.deadline_s is not None and self.wall_clock() > request.deadline_s:
            raise DeadlineExceeded(self._late_message(request, stage))

    def _count(self, name: str, n: int = 1) -> None:
        with self._counter_lock:
            self._counters[name] += n

    def _count_outcome(self, outcome: Outcome) -> None:
        self._count(OUTCOME_COUNTERS[outcome])

    def _count_miss(self, reason: MissReason) -> None:
        """A miss, and its reason, in one step: a reader never sees one without the other."""
        with self._counter_lock:
            self._counters[OUTCOME_COUNTERS[Outcome.MISS]] += 1
            self._misses[reason] += 1

    def _maybe_expire(self) -> None:
        """Free expired entries now and then: a tenth of the shorter TTL, at least every second (a read
        checks its entry's TTL anyway; this only returns the memory)."""
        now = self.clock()
        if now - self._last_expiry >= max(1.0, self.cache.min_ttl_s / 10):
            self._last_expiry = now
            self.cache.expire()

    def stats(self) -> EngineStats:
        with self._counter_lock:
            counters = {name: int(self._counters.get(name, 0)) for name in COUNTERS}
            misses = {reason: int(self._misses.get(reason, 0)) for reason in MISS_REASONS}
            latency = self._rank_latency.copy()
        tiers = self.cache.figures()
        hbm = tiers[Outcome.HBM]
        counters.update(
            evictions=hbm.counters.evictions,
            demotions=self.cache.demotions,
            promotions=self.cache.promotions,
            expirations=sum(t.counters.expirations for t in tiers.values()),
            dedup_reloads=self.cache.dedup_reloads,
            **{LOWER_TIER_EVICTIONS[name]: t.counters.evictions for name, t in tiers.items() if name != Outcome.HBM},
        )
        refusals = {reason: int(self.trigger.refusals.get(reason, 0)) for reason in REFUSAL_REASONS}
        state = self._state
        return EngineStats(
            name=self.name,
            device=str(self.device),
            model_version=self.model.version,
            policy_sha256=state.policy.sha256(),
            edit_hash=state.edit.content_hash,
            counters=counters,
            refusals=refusals,
            rank_latency=latency,
            hbm_bytes=hbm.bytes,
            hbm_budget_bytes=hbm.budget_bytes,
            hbm_peak_bytes=hbm.peak_bytes,
            hbm_entries=hbm.entries,
            device_allocated_bytes=devices.device_allocated_bytes(self.device),
            tiers=tiers,
            misses=misses,
        )
