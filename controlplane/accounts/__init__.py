"""Users, roles (viewer < operator < admin) and API tokens (stored as sha256 digests only)."""
