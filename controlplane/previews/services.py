"""Writes of the previews app: request a preview (or reuse the cached one), run it, record its end;
and the audited download of captured traffic.

A preview runs on the control plane's Celery queue ``<prefix>.controlplane.previews`` (``tasks``), in
a worker process of its own (never the bake's): it exports the captured window to a trace file and
runs ``python -m relay_engine.sim preview`` as a subprocess (the control plane never imports the
lab), live spec vs proposed spec, same requests, the pool's live instance count and the cost
model of its own forwards over the last 15 minutes at least (``telemetry.forwards``; the simulator
fits it, the offline profile of its device where they are too few). Previews queued or running at once are bounded per pool and per user
(``RELAYGR_PREVIEW_MAX_PER_POOL``, ``RELAYGR_PREVIEW_MAX_PER_USER``): one more is a 429 naming the
limit and what holds it. Starting a preview and downloading captured traffic are audited.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.celery_app import app as celery_app
from controlplane.common.errors import Conflict, TooManyRequests
from controlplane.common.redis import get_redis, redis_unreachable
from controlplane.policies import selectors as policy_selectors
from controlplane.policies.models import Pool
from controlplane.telemetry.forwards import DEFAULT_WINDOW_S, MAX_WINDOW_S, pool_forward_times
from relay_engine.core.capture import trace_order
from relay_engine.core.config import slo_of
from relay_engine.core.lifetime import die_with_parent
from relay_engine.core.wire import InstanceStatus, PoolKeys, WireError, live_members

from . import selectors, traffic
from .models import Preview

log = logging.getLogger(__name__)

# Routed to ``<prefix>.controlplane.previews`` by CELERY_TASK_ROUTES (``relaygr.controlplane.preview*``).
PREVIEW_TASK = "relaygr.controlplane.preview_run"
# The simulator's budget: a preview that runs longer is failed (and says so), never left running.
SIM_TIMEOUT_S = 300
# An error kept for the reader: the end of the simulator's stderr, never only a traceback.
ERROR_TAIL_CHARS = 2000
# A preview queued or running this long has lost its worker (``_fail_abandoned``).
ABANDONED_AFTER_S = 2 * SIM_TIMEOUT_S
# A preview refused by a limit is asked to come back after about one simulator run.
RETRY_AFTER_S = 15
# Previews named in a refusal (those holding the limit, oldest first).
MAX_LISTED = 10
# The traffic before a window that a preview replays first, unmeasured, so its caches start as the
# instances' did: the live spec's longest cache TTL (nothing older can still be cached), at most this.
MAX_WARMUP_LEAD_S = 300
IN_PROGRESS = (Preview.Status.QUEUED, Preview.Status.RUNNING)


def window_end_of(now_s: float, window_s: int) -> float:
    """The window's end, rounded down to a fifteenth of the window (1 min for 15 min, at most 1 min):
    repeated clicks within that step reuse one preview, and it stays small against the window."""
    step_s = max(1, min(60, window_s // 15))
    return now_s // step_s * step_s


def _as_datetime(unix_s: float) -> datetime:
    return datetime.fromtimestamp(unix_s, tz=UTC)


def preview_request(*, pool: Pool, generation: int, window_s: int, actor: str,
                    now_s: float | None = None) -> tuple[Preview, bool]:
    """The preview of ``generation`` against the live revision on the window ending now (rounded
    down): the existing one when the same specs and window were already asked for (and it did not
    fail), else a new queued one. NotFound for an unknown generation; Conflict when the window
    holds no captured traffic. Returns (preview, created)."""
    proposed = policy_selectors.revision_get(pool=pool, generation=generation)
    live = policy_selectors.revision_desired(pool=pool)
    _fail_abandoned()
    end_s = window_end_of(time.time() if now_s is None else now_s, window_s)
    window_end = _as_datetime(end_s)
    question = dict(pool=pool, sha256=proposed.sha256, live_sha256=live.sha256, window_s=window_s,
                    window_end=window_end)
    existing = Preview.objects.filter(**question).exclude(status=Preview.Status.FAILED).first()
    if existing is not None:
        return existing, False
    if not traffic.has_traffic(pool=pool.name, start_s=end_s - window_s, end_s=end_s):
        extent = traffic.capture_extent(pool=pool.name)
        raise Conflict(f"No captured traffic of pool {pool.name!r} in the last {traffic.window_label(window_s)} "
                       f"(the window ending {window_end:%H:%M:%S} UTC): {extent.describe(end_s)}. A preview "
                       f"replays captured ranking traffic; send traffic to the pool or choose a longer window.")
    try:
        with transaction.atomic():
            # The count and the new row under one lock (the user's, then the pool's), so racing
            # requests cannot all pass a limit; on SQLite the IMMEDIATE transaction is that lock.
            get_user_model().objects.select_for_update().filter(username=actor).first()
            Pool.objects.select_for_update().filter(pk=pool.pk).first()
            _check_limits(pool=pool, actor=actor)
            preview = Preview.objects.create(**question, generation=proposed.generation,
                                             live_generation=live.generation, requested_by=actor)
            audit_record(actor=actor, action=AuditEntry.Action.PREVIEW_START, object_type="preview",
                         object_id=str(preview.pk), pool=pool.name, after={
                             "generation": preview.generation, "live_generation": preview.live_generation,
                             "window": traffic.window_label(window_s), "window_end": window_end.isoformat()})
    except IntegrityError:  # the same question asked at the same moment: its winner answers both
        return Preview.objects.filter(**question).exclude(status=Preview.Status.FAILED).get(), False
    transaction.on_commit(lambda: _enqueue(preview.pk))  # the worker must find the row it is given
    return preview, True


def _check_limits(*, pool: Pool, actor: str) -> None:
    """TooManyRequests when the pool, or the user over every pool, already has as many previews
    queued or running as its limit allows; the message names the limit and those previews."""
    in_progress = Preview.objects.filter(status__in=IN_PROGRESS).select_related("pool").order_by("created_at", "id")
    for who, held, setting in (
        (f"Pool {pool.name!r}", in_progress.filter(pool=pool), "RELAYGR_PREVIEW_MAX_PER_POOL"),
        (f"User {actor!r}", in_progress.filter(requested_by=actor), "RELAYGR_PREVIEW_MAX_PER_USER"),
    ):
        limit = getattr(settings, setting)
        count = held.count()
        if count < limit:
            continue
        listed = "; ".join(f"preview {p.pk} of {p.pool.name} generation {p.generation}, {p.status}, by "
                           f"{p.requested_by}" for p in held[:MAX_LISTED])
        raise TooManyRequests(
            f"{who} already has {count} previews queued or running, the most {setting} allows ({limit}): "
            f"{listed}. Ask again once one has finished (about {RETRY_AFTER_S} s), or reuse one of them.",
            RETRY_AFTER_S)


def _fail_abandoned() -> None:
    """A preview still queued or running long after any simulation would have ended lost its worker
    (stopped, or never started): it fails, saying so, is no longer reused, and no longer counts
    against a limit."""
    cutoff = timezone.now() - timedelta(seconds=ABANDONED_AFTER_S)
    Preview.objects.filter(status__in=IN_PROGRESS, created_at__lt=cutoff).update(
        status=Preview.Status.FAILED, finished_at=timezone.now(),
        error=f"Not finished {ABANDONED_AFTER_S // 60} minutes after it was asked for: the control plane's Celery "
              f"worker (queue <prefix>.controlplane.previews) stopped or is not running.")


def _enqueue(preview_id: int) -> None:
    try:
        celery_app.send_task(PREVIEW_TASK, args=[preview_id])
    except Exception as exc:  # noqa: BLE001 — the broker is down: say so on the preview itself
        preview_fail(preview_id=preview_id, error=f"The preview could not be queued: the control plane's "
                                                  f"Celery broker (REDIS_URL) is unreachable ({type(exc).__name__}).")


def traffic_download(*, pool: Pool, window_s: int, actor: str, end_s: float | None = None) -> Iterator[str]:
    """The pool's captured traffic of the window ending now (or at ``end_s``), as trace lines; the download
    is audited (who took which window, how many requests), since the hashed users are a pool's traffic too."""
    window = traffic.read_window(pool=pool.name, window_s=window_s, end_s=end_s)
    with transaction.atomic():
        audit_record(actor=actor, action=AuditEntry.Action.TRAFFIC_DOWNLOAD, object_type="traffic",
                     object_id=f"{pool.name}:{traffic.window_label(window_s)}", pool=pool.name,
                     after={"window": traffic.window_label(window_s), "from": window.start_s, "to": window.end_s,
                            "requests": len(window.records)})
    return traffic.trace_lines(window)


def preview_fail(*, preview_id: int, error: str) -> None:
    Preview.objects.filter(pk=preview_id).update(status=Preview.Status.FAILED, error=error[:ERROR_TAIL_CHARS],
                                                 finished_at=timezone.now())


@dataclass(frozen=True)
class SimulatedFleet:
    """What the simulated fleet mirrors of the pool: its live instances, their device kind and, for
    CPU instances that share hosts, how many to a host and its cores."""

    instances: int
    device_kind: str
    note: str
    instances_per_host: int = 1
    host_cores: int = 1


def pool_fleet(*, pool: Pool) -> SimulatedFleet:
    keys = PoolKeys(pool.name)
    now = time.time()
    try:
        client = get_redis()
        names, _ = live_members(client, keys, now=now)
        raws = client.mget([keys.status(name) for name in names]) if names else []
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    statuses = []
    for raw in filter(None, raws):
        try:
            statuses.append(InstanceStatus.from_json(raw))
        except WireError:
            continue
    devices = [status.device.split(":")[0] for status in statuses]
    kind = pool.device_kind if pool.device_kind != "auto" else (max(set(devices), key=devices.count)
                                                                if devices else "auto")
    if not names:
        return SimulatedFleet(pool.expected_instances, kind,
                              f"no live instance now: the pool's expected {pool.expected_instances}")
    note = f"{len(names)} live instances"
    # Single-threaded CPU instances on one host share its cores: the simulator shares them the same way.
    cpu = [st for st in statuses if st.device.startswith("cpu") and st.host and st.host_cpus > 0
           and st.torch_threads == 1]
    if kind != "cpu" or not cpu:
        return SimulatedFleet(len(names), kind, note)
    hosts = Counter(st.host for st in cpu)
    per_host = max(hosts.values())
    cores = min(st.host_cpus for st in cpu if hosts[st.host] == per_host)
    note += (f", {per_host} to a host of {cores} cores" if len(hosts) == 1 else
             f" on {len(hosts)} hosts (simulated {per_host} to a host of {cores} cores, the most crowded)")
    return SimulatedFleet(len(names), kind, note, per_host, cores)


def _sim_command(paths: dict[str, Path], fleet: SimulatedFleet, warmup_requests: int = 0) -> list[str]:
    command = [sys.executable, "-m", "relay_engine.sim", "preview", "--trace", str(paths["trace"]),
               "--live", str(paths["live"]), "--proposed", str(paths["proposed"]),
               "--instances", str(fleet.instances), "--device-kind", fleet.device_kind,
               "--forward-times", str(paths["forwards"]), "--out", str(paths["out"])]
    if fleet.instances_per_host > 1 or fleet.host_cores > 1:
        command += ["--instances-per-host", str(fleet.instances_per_host), "--host-cores", str(fleet.host_cores)]
    if settings.RELAYGR_PREVIEW_MAX_REQUESTS:
        command += ["--max-requests", str(settings.RELAYGR_PREVIEW_MAX_REQUESTS)]
    if warmup_requests:
        command += ["--warmup-requests", str(warmup_requests)]
    return command


def _background() -> Callable[[], None]:
    """The simulator's ``preexec_fn``: it dies with this worker, and runs at ``RELAYGR_PREVIEW_NICE`` (a
    preview measured beside a pool on one host took both cores for its seconds, and the pool's prefills,
    at their lane's lower priority, fell behind: the very traffic the next preview replays)."""
    follow = die_with_parent()
    nice = settings.RELAYGR_PREVIEW_NICE

    def preexec() -> None:
        if follow is not None:
            follow()
        os.nice(nice)

    return preexec


def _error_tail(stderr: str) -> str:
    """The simulator's own ``error: …`` line when it printed one, else the end of its output."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    said = [line for line in lines if line.startswith("error:")]
    if said:
        return said[-1].removeprefix("error:").strip()
    if any(line.startswith("Traceback") for line in lines):  # the exception's own line says what broke
        return f"it raised {lines[-1].strip()[:ERROR_TAIL_CHARS]}"
    return "\n".join(lines[-12:])[-ERROR_TAIL_CHARS:] or "no output"


def preview_execute(*, preview_id: int) -> Preview:
    """Run one queued preview to its end (done or failed); idempotent: a preview already running or
    finished is left as it is."""
    claimed = Preview.objects.filter(pk=preview_id, status=Preview.Status.QUEUED).update(
        status=Preview.Status.RUNNING, started_at=timezone.now())
    preview = Preview.objects.select_related("pool").get(pk=preview_id)
    if not claimed:
        return preview
    started = time.monotonic()
    try:
        result = _simulate(preview)
    except PreviewFailed as exc:
        preview_fail(preview_id=preview_id, error=str(exc))
    except Exception as exc:  # noqa: BLE001 — a preview never crashes the worker; the reader gets a sentence
        log.exception("preview %s failed", preview_id)
        preview_fail(preview_id=preview_id, error=f"The preview failed unexpectedly ({type(exc).__name__}: {exc}).")
    else:
        result["wall_s"] = round(time.monotonic() - started, 2)
        Preview.objects.filter(pk=preview_id).update(status=Preview.Status.DONE, result=result,
                                                     finished_at=timezone.now())
    preview.refresh_from_db()
    return preview


class PreviewFailed(Exception):
    pass


def warmup_lead_s(spec: dict, window_s: int) -> int:
    """Seconds of traffic before the window to warm a preview's caches with (see MAX_WARMUP_LEAD_S)."""
    cache = spec.get("cache") if isinstance(spec.get("cache"), dict) else {}
    ttls = [cache.get(k) for k in ("entry_ttl_ms", "dram_ttl_ms")]
    longest_s = max((t / 1000 for t in ttls if isinstance(t, (int, float)) and not isinstance(t, bool)),
                    default=MAX_WARMUP_LEAD_S)
    return int(max(1, min(MAX_WARMUP_LEAD_S, window_s, longest_s)))


def _simulate(preview: Preview) -> dict:
    pool = preview.pool
    end_s = preview.window_end.timestamp()
    window = traffic.read_window(pool=pool.name, window_s=preview.window_s, end_s=end_s)
    lines = list(traffic.trace_lines(window))
    if len(lines) < 2:
        raise PreviewFailed(f"The window holds {len(lines)} replayable requests; a preview needs at least 2.")
    live = policy_selectors.revision_get(pool=pool, generation=preview.live_generation)
    # The traffic just before the window, replayed first and not measured: warm caches, as the pool's.
    lead_s = warmup_lead_s(live.spec, preview.window_s)
    lead = traffic.read_window(pool=pool.name, window_s=lead_s, end_s=end_s - preview.window_s)
    warmup_requests = sum(1 for _ in traffic.trace_lines(lead))
    replayed = lead.records + window.records if warmup_requests else window.records
    if warmup_requests:
        lines = list(traffic.trace_lines(traffic.CaptureWindow(start_s=lead.start_s, end_s=end_s, records=replayed)))
    proposed = policy_selectors.revision_get(pool=pool, generation=preview.generation)
    fleet = pool_fleet(pool=pool)
    try:  # the pool's own forward times: the simulator fits its cost model from them
        forward_times = pool_forward_times(get_redis(), pool=pool.name,
                                           window_s=min(MAX_WINDOW_S, max(DEFAULT_WINDOW_S, preview.window_s)))
    except redis.RedisError as exc:
        raise redis_unreachable(exc) from exc
    with tempfile.TemporaryDirectory(prefix="relaygr-preview-") as tmp:
        paths = {name: Path(tmp) / f"{name}.json" for name in ("live", "proposed", "out", "forwards")}
        paths["forwards"].write_text(json.dumps(forward_times), encoding="utf-8")
        paths["trace"] = Path(tmp) / "trace.jsonl"
        paths["trace"].write_text("".join(lines), encoding="utf-8")
        paths["live"].write_text(json.dumps(live.spec), encoding="utf-8")
        paths["proposed"].write_text(json.dumps(proposed.spec), encoding="utf-8")
        try:
            done = subprocess.run(_sim_command(paths, fleet, warmup_requests), capture_output=True, text=True,
                                  timeout=SIM_TIMEOUT_S, cwd=settings.BASE_DIR, preexec_fn=_background(),
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                      filter(None, [str(settings.BASE_DIR), os.environ.get("PYTHONPATH")]))})
        except subprocess.TimeoutExpired:
            raise PreviewFailed(f"The simulator ran past {SIM_TIMEOUT_S} s and was stopped.") from None
        if done.returncode != 0:
            raise PreviewFailed(f"The simulator failed (exit {done.returncode}): {_error_tail(done.stderr)}")
        result = json.loads(paths["out"].read_text(encoding="utf-8"))
        if settings.RELAYGR_PREVIEW_KEEP_DIR:
            _keep(preview, paths, replayed, _sim_command(paths, fleet, warmup_requests))
    result.update({
        "window": traffic.window_label(preview.window_s), "window_from": end_s - preview.window_s,
        "warmup_lead_s": lead_s if warmup_requests else 0,
        "window_to": end_s, "captured_in_window": len(window.records), "skipped_records": window.bad,
        "instances_note": fleet.note, "device_kind": fleet.device_kind,
        "slo_ms": {"live": _slo_ms(live.spec), "proposed": _slo_ms(proposed.spec)},
        "hbm_budget_bytes": {"live": _hbm_budget_bytes(live.spec), "proposed": _hbm_budget_bytes(proposed.spec)},
    })
    result.update(model_error_of(pool=pool, validation=(result.get("model_error"), result.get("model_error_note"))))
    return result


def _keep(preview: Preview, paths: dict[str, Path], records: list, command: list[str]) -> None:
    """What this preview replayed, kept in ``RELAYGR_PREVIEW_KEEP_DIR/preview-<id>/``: the simulator's
    inputs and output under their own names, the cost profile it started from (``profile.json``),
    ``capture.jsonl`` (the captured records in the trace's
    order, with each request's outcome and latency as the instance measured them: line i is query i)
    and ``command.json``. A folder that cannot be written is logged, never a failed preview."""
    folder = Path(settings.RELAYGR_PREVIEW_KEEP_DIR) / f"preview-{preview.pk}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for path in paths.values():
            shutil.copyfile(path, folder / path.name)
        profile = Path(str((json.loads(paths["out"].read_text(encoding="utf-8")).get("profile") or {}).get("path")))
        if profile.is_file():  # the cost profile the simulator started from (a stack's lives in its data dir)
            shutil.copyfile(profile, folder / "profile.json")
        with (folder / "capture.jsonl").open("w", encoding="utf-8") as out:
            for _, record in trace_order(records):
                out.write(json.dumps(record.to_fields(), separators=(",", ":")) + "\n")
        (folder / "command.json").write_text(json.dumps({
            "argv": command[command.index("preview"):], "pool": preview.pool.name, "generation": preview.generation,
            "live_generation": preview.live_generation, "window_s": preview.window_s,
            "window_end": preview.window_end.timestamp()}, indent=2), encoding="utf-8")
    except OSError as exc:
        log.warning("preview %s: could not keep its inputs in %s: %s", preview.pk, folder, exc)


def model_error_of(*, pool: Pool, validation: tuple[float | None, str | None] = (None, None)) -> dict:
    """A preview's ``model_error``: the largest |P99 error| of the pool's last scored previews
    (``selectors.scorecard``), None while it has none; ``model_error_note`` says which, and
    ``scorecard`` holds the summary. The simulator's own offline validation figure is kept apart
    (``sim_validation``): what was measured on this pool is what a reader should trust."""
    card = selectors.scorecard(pool=pool)
    error = card.get("p99_within_pct")
    return {"model_error": None if error is None else round(error / 100, 4), "model_error_note": card["note"],
            "scorecard": card, "sim_validation": {"model_error": validation[0], "note": validation[1]}}


def _slo_ms(spec: dict) -> float | None:
    return slo_of(spec).p99_ms


def _hbm_budget_bytes(spec: dict) -> int | None:
    mb = (spec.get("cache") or {}).get("hbm_budget_mb")
    return int(mb * 2**20) if isinstance(mb, (int, float)) else None
