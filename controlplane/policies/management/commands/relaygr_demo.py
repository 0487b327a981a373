"""Prepare a demo control plane: a pool and an operator who can log in, idempotently.

Used by the one-command stack (``make run``). Prints one JSON line with the user, password and a
fresh API token, which the launcher shows once; nothing is printed or logged anywhere else.
"""

import json
import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from controlplane.accounts import services as accounts
from controlplane.accounts.roles import Role
from controlplane.policies import services
from controlplane.policies.models import Pool

ACTOR = "cli:relaygr_demo"


class Command(BaseCommand):
    help = "Create (or reuse) a demo pool and operator; print {user, password, token, pool} as JSON."

    def add_arguments(self, parser):
        parser.add_argument("--pool", default="main")
        parser.add_argument("--instances", type=int, default=2, help="expected instances of the pool")
        parser.add_argument("--user", default="demo")
        parser.add_argument("--password", default="", help="default: a new random password each run")

    def handle(self, *args, pool, instances, user, password, **options):
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
            services.pool_create(name=pool, description="demo pool started by make run",
                                 expected_instances=instances, actor=ACTOR)
        token = accounts.token_create(user=account, actor=ACTOR, name="make run")
        self.stdout.write(json.dumps({"user": user, "password": password, "token": token.key, "pool": pool}))
