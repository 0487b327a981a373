"""No tables: this app's read model lives in Redis (written by the workers)."""
