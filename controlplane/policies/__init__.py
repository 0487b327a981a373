"""Pools, their immutable configuration revisions, publishing to Redis, and the audit trail."""
