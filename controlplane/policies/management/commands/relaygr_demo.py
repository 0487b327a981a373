"""Prepare a demo control plane: a pool and an operator who can log in, idempotently.

Used by the one-command stack (``make run``). Prints one JSON line with the user, password and a
fresh API token, which the launcher shows once; nothing is printed or logged anywhere else.

``--slo-ms`` puts the demo pool on the stack's time scale (``workers.stack``: the reference
accelerator's SLO × K on a slower machine): while the pool's desired revision is still the demo's own
(authored by this command), a revision with that SLO is created and published; a revision anyone
else published is left alone.
"""

import json
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from controlplane.accounts import services as accounts
from controlplane.accounts.roles import Role
from controlplane.common.errors import ServiceError
from controlplane.policies import selectors, services
from controlplane.policies.models import Pool
from relay_engine.core.config import parse_policy, to_plain

ACTOR = "cli:relaygr_demo"


class Command(BaseCommand):
    help = "Create (or reuse) a demo pool and operator; print {user, password, token, pool} as JSON."

    def add_arguments(self, parser):
        parser.add_argument("--pool", default="main")
        parser.add_argument("--instances", type=int, default=2, help="expected instances of the pool")
        parser.add_argument("--user", default="demo")
        parser.add_argument("--password", default="", help="default: a new random password each run")
        parser.add_argument("--slo-ms", type=float, help="the demo pool's ranking SLO (trigger.ranking_p99_slo_ms)")
        parser.add_argument("--time-note", default="", help="why the pool's times are what they are (its description)")
        parser.add_argument("--latency-model", type=json.loads, help="trigger.latency_model on this machine (JSON)")

    def handle(self, *args, pool, instances, user, password, slo_ms, time_note, latency_model, **options):
        if not 1 <= instances <= 1024:
            raise CommandError(f"--instances must be in [1, 1024], got {instances}")
        password = password or secrets.token_urlsafe(9)
        User = get_user_model()
        with transaction.atomic():
            account = User.objects.filter(username=user).first()
            if account is None:
                account = accounts.user_create(username=user, role=Role.OPERATOR, actor=ACTOR, password=password)
            else:
                accounts.user_role_set(user=account, role=Role.OPERATOR, actor=ACTOR)
                account.set_password(password)
                account.save(update_fields=["password"])
        if not Pool.objects.filter(name=pool).exists():
            note = f"demo pool started by make run; {time_note}" if time_note else "demo pool started by make run"
            services.pool_create(name=pool, description=note[:500], expected_instances=instances, actor=ACTOR)
        if slo_ms is not None:
            self._calibrate(Pool.objects.get(name=pool), slo_ms, time_note, latency_model)
        token = accounts.token_create(user=account, actor=ACTOR, name="make run")
        self.stdout.write(json.dumps({"user": user, "password": password, "token": token.key, "pool": pool}))

    def _calibrate(self, pool: Pool, slo_ms: float, note: str, latency_model: dict | None) -> None:
        desired = selectors.revision_desired(pool=pool)
        latest = selectors.revision_list(pool=pool).first()
        if desired.author != ACTOR or latest.generation != desired.generation:
            return  # someone else's revision (or one being prepared): theirs to change
        spec = to_plain(parse_policy(desired.spec))
        calibrated = {"ranking_p99_slo_ms": slo_ms, **({"latency_model": latency_model} if latency_model else {})}
        if all(spec["trigger"].get(key) == value for key, value in calibrated.items()):
            return
        spec["trigger"].update(calibrated)
        try:
            revision = services.revision_create(pool=pool, spec=spec, parent_generation=desired.generation,
                                                author=ACTOR, comment=f"the stack's time scale: {note}"[:1000])
        except ServiceError as exc:
            raise CommandError(f"--slo-ms {slo_ms:g}: {exc.detail}") from None
        services.revision_publish(pool=pool, generation=revision.generation, actor=ACTOR)
