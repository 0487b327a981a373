"""Roles are Django groups with a rank; a user's role is the highest one it holds.

viewer (product teams) reads everything; operator (SREs) also creates, publishes and rolls back;
admin also manages pools, users and tokens. A superuser counts as admin.
"""

from __future__ import annotations

import enum


class Role(enum.IntEnum):
    VIEWER = 1
    OPERATOR = 2
    ADMIN = 3

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, value: str) -> Role:
        try:
            return cls[value.upper()]
        except KeyError:
            raise ValueError(f"unknown role {value!r}; allowed: {', '.join(r.label for r in cls)}") from None


ROLE_NAMES = tuple(r.label for r in Role)


def role_of(user) -> Role | None:
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if user.is_superuser:
        return Role.ADMIN
    cached = getattr(user, "_relaygr_role", False)
    if cached is not False:
        return cached
    names = set(user.groups.filter(name__in=ROLE_NAMES).values_list("name", flat=True))
    held = [Role.parse(n) for n in names]
    role = max(held) if held else None
    user._relaygr_role = role
    return role
