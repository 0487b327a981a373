"""Write every pool's desired revision from the database into Redis (idempotent repair)."""

import time

from django.core.management.base import BaseCommand, CommandError

from controlplane.common.errors import Unavailable
from controlplane.policies.services import desired_sync


class Command(BaseCommand):
    help = "Re-write every pool's desired revision into Redis; with --interval, keep doing so."

    def add_arguments(self, parser):
        parser.add_argument("--interval", type=float, default=0.0,
                            help="seconds between syncs; 0 (default) syncs once and exits")

    def handle(self, *args, interval, **options):
        while True:
            try:
                result = desired_sync()
                self.stdout.write(f"synced {result['pools']} pool(s) to Redis")
            except Unavailable as exc:
                if not interval:
                    raise CommandError(exc.detail) from exc
                self.stderr.write(exc.detail)
            if not interval:
                return
            time.sleep(interval)
