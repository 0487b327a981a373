"""Create (or reuse) a user with a role and print a new API token for it, once."""

from django.core.management.base import BaseCommand, CommandError

from controlplane.accounts import services
from controlplane.accounts.roles import ROLE_NAMES, Role
from controlplane.accounts.selectors import user_get
from controlplane.common.errors import NotFound

ACTOR = "cli:relaygr_token"


class Command(BaseCommand):
    help = "Create a user with a role (or set an existing user's role) and print a new API token."

    def add_arguments(self, parser):
        parser.add_argument("--user", required=True, help="user name")
        parser.add_argument("--role", required=True, choices=ROLE_NAMES)
        parser.add_argument("--read-only", action="store_true", help="the token may only read")
        parser.add_argument("--name", default="", help="what the token is for")

    def handle(self, *args, user, role, read_only, name, **options):
        role_value = Role.parse(role)
        try:
            account = user_get(username=user)
            services.user_role_set(user=account, role=role_value, actor=ACTOR)
        except NotFound:
            if len(user) > 150 or not user.strip():
                raise CommandError("--user must be 1-150 characters") from None
            account = services.user_create(username=user, role=role_value, actor=ACTOR)
        issued = services.token_create(user=account, actor=ACTOR, name=name, read_only=read_only)
        self.stdout.write(issued.key)
        self.stderr.write(f"token {issued.token.key_prefix}… for {user} ({role}{', read-only' if read_only else ''}); "
                          "store it now, it is not shown again")
