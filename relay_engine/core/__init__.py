"""The serving core: everything a worker process loads, on stdlib, numpy and torch alone.

``config`` (the policy schema) and ``fields`` (its field checks), ``wire`` (the Redis contract
between the control plane and the workers), ``telemetry``, ``outcomes`` (where a prefix was
served from, and the per-tier figures), ``tiers`` (the cache tier stack: the one thing outside the core
asks), ``model`` (HSTU), ``kvcache`` (HBM tier), ``dram`` and ``disk`` (the tiers under it),
``trigger``, ``router``, ``engine`` (one instance), ``devices``, ``trace`` (the trace format),
``features`` (token ids for trace queries), ``editing_io`` (editing configurations as files) and
``edit_tensors`` (an edit as the model runs it). Nothing here imports ``relay_engine.lab``.
"""
