"""Users with a role, and API tokens: each change audited; a token's key exists only in the return
value of ``token_create`` (the database keeps its sha256)."""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction
from django.utils import timezone

from controlplane.audit.models import AuditEntry
from controlplane.audit.services import audit_record
from controlplane.common.errors import Conflict, NotFound

from .models import ApiToken, token_digest
from .roles import ROLE_NAMES, Role, role_of

KEY_PREFIX = "rgr_"


def _role_set(*, user, role: Role) -> None:
    user.groups.remove(*Group.objects.filter(name__in=ROLE_NAMES))
    group, _ = Group.objects.get_or_create(name=role.label)
    user.groups.add(group)
    user._relaygr_role = False  # drop the cached role


def user_create(*, username: str, role: Role, actor: str, password: str | None = None):
    User = get_user_model()
    with transaction.atomic():
        if User.objects.filter(username=username).exists():
            raise Conflict(f"User {username!r} already exists.", errors={"username": ["already exists"]})
        user = User.objects.create_user(username=username, password=password)
        if password is None:
            user.set_unusable_password()
            user.save(update_fields=["password"])
        _role_set(user=user, role=role)
        audit_record(actor=actor, action=AuditEntry.Action.USER_CREATE, object_type="user", object_id=username,
                     after={"username": username, "role": role.label})
    return user


def user_role_set(*, user, role: Role, actor: str) -> None:
    before = role_of(user)
    if before == role:
        return
    with transaction.atomic():
        _role_set(user=user, role=role)
        audit_record(actor=actor, action=AuditEntry.Action.USER_ROLE, object_type="user",
                     object_id=user.get_username(), before={"role": before.label if before else None},
                     after={"role": role.label})


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    key: str  # shown once; never stored


def token_create(*, user, actor: str, name: str = "", read_only: bool = False) -> IssuedToken:
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with transaction.atomic():
        token = ApiToken.objects.create(user=user, name=name, key_digest=token_digest(key),
                                        key_prefix=key[:10], read_only=read_only)
        audit_record(actor=actor, action=AuditEntry.Action.TOKEN_CREATE, object_type="token", object_id=str(token.pk),
                     after={"user": user.get_username(), "name": name, "key_prefix": token.key_prefix,
                            "read_only": read_only})
    return IssuedToken(token=token, key=key)


def token_revoke(*, token_id: int, actor: str) -> ApiToken:
    with transaction.atomic():
        token = ApiToken.objects.select_for_update().filter(pk=token_id).first()
        if token is None:
            raise NotFound(f"Token {token_id} does not exist.")
        if token.revoked_at is None:
            token.revoked_at = timezone.now()
            token.save(update_fields=["revoked_at"])
            audit_record(actor=actor, action=AuditEntry.Action.TOKEN_REVOKE, object_type="token",
                         object_id=str(token.pk), before={"revoked": False},
                         after={"revoked": True, "user": token.user.get_username(), "key_prefix": token.key_prefix})
    return token
