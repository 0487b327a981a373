"""Read model of the worker fleet: per-instance status and heartbeats, read from Redis."""
