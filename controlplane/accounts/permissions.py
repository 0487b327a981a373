"""Deny by default: reading needs the view's ``read_role`` (viewer unless it says otherwise), any
other method its ``write_role`` (operator unless it says otherwise); a read-only token never writes."""

from __future__ import annotations

from rest_framework.permissions import SAFE_METHODS, BasePermission

from .models import ApiToken
from .roles import Role, role_of


class RolePermission(BasePermission):
    def has_permission(self, request, view) -> bool:
        role = role_of(request.user)
        if role is None:
            self.message = "Your account holds no role; ask an admin for viewer, operator or admin."
            return False
        if request.method in SAFE_METHODS:
            needed = getattr(view, "read_role", Role.VIEWER)
        else:
            if isinstance(request.auth, ApiToken) and request.auth.read_only:
                self.message = "This token is read-only."
                return False
            needed = getattr(view, "write_role", Role.OPERATOR)
        if role < needed:
            self.message = f"This needs the {needed.label} role; you hold {role.label}."
            return False
        return True
