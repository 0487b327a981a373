"""Write every pool's desired revision, and its canary overrides, from the database into Redis
(idempotent repair).

With ``--interval`` it is the loop a deployment runs beside the web server, and it must outlive
whatever it depends on: Redis down or restarted empty, the database locked by a long write or
unreachable. Each failed pass is reported on stderr and retried after the interval; the connection
is reopened if it broke. Without ``--interval`` one pass runs, and a failure is the exit status.
"""

import time

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, close_old_connections

from controlplane.common.errors import ServiceError
from controlplane.policies.services import desired_sync
from controlplane.rollouts.services import rollout_sync


class Command(BaseCommand):
    help = "Re-write every pool's desired revision into Redis; with --interval, keep doing so."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=0.0,
                            help="seconds between syncs; 0 (default) syncs once and exits")

    def handle(self, *args, interval, **options):
        while True:
            try:
                result = desired_sync()
                rollouts = rollout_sync()
                self.stdout.write(f"synced {result['pools']} pool(s) to Redis ({rollouts['rollouts']} with a "
                                  "canary rollout)")
            except (ServiceError, DatabaseError) as exc:
                problem = exc.detail if isinstance(exc, ServiceError) else (
                    f"the database cannot be read or written ({type(exc).__name__}: {exc})")
                if not interval:
                    raise CommandError(problem) from exc
                self.stderr.write(f"sync failed, retrying in {interval:g} s: {problem}")
                close_old_connections()  # a broken or timed-out connection is opened afresh
            if not interval:
                return
            time.sleep(interval)
