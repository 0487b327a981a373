"""Settings modules: ``base`` (shared), ``dev`` (local), ``prod`` (secrets from the environment only),
``test`` (pytest-django)."""
