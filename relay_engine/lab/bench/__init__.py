"""The benchmark: how much longer a sequence and how much more SLO-compliant throughput relay-race
inference sustains than full inference at ranking, on the same trace, machine and queries, in one run.

    python -m relay_engine.bench [--trace FILE] [--slo-ms 50] [--time-scale K|auto] [--instances N]
                                 [--cap-sweep] [--fleet lab|product|both] [--out artifacts/bench.json] [--quick]

* **Instances** (``instances``): N engine processes with the same seeded weights, each pinned to its
  own cores, each serving ranking on ``rank_threads`` threads and pre-inference on the engine's lane
  at the policy's compute share.
* **Fleets** (``--fleet``): the lab's instances above (``lab``, the default); the product's path
  (``product``: ``RelayClient`` → Redis → worker instances started by the pool supervisor, each mode a
  published policy, see ``product``); or ``both`` in one run on the same windows, the product's ratio
  being the headline.
* **Regime** (``calibration``, ``modes.Regime``): the cost model is measured inside instance 0; the
  time scale K compares it with a stated reference profile (``--time-scale auto``), and every time
  constant of the trace — arrival gaps, the retrieval → ranking gap — as well as the SLO, the
  deadline and the caches' TTLs are × K here. The output gives K and both the scaled figures and the
  unscaled ones (the reference device's: loads × K, latencies ÷ K).
* **Points** (``workload``, ``stats``): every point of every mode replays the same paired windows
  (primed caches, a warm-up, ≥ 2,000 measured ranking requests), reports ``n``, P99 and its bootstrap
  95 % interval, and passes when its P99 estimate meets the SLO. The host is watched while the
  point runs (``host``); a busy point is measured again.
* **Sweeps** (``sweeps``): the longest prefix cap meeting the SLO at the reference load, and the
  highest load meeting it at the headline cap (the baseline's max sequence length) for every mode
  (the ablations included); with ``--cap-sweep`` also at caps 512…4096. The simulator, on the same
  cost model and windows, predicts each sweep's crossing so the real one starts there.
* **Ratios**: relay ÷ baseline of the interpolated crossings, with bootstrap 95 % intervals
  (``ratios.slo_throughput_ci``, ``ratios.max_seq_len_ci``), and the engine's own overhead over the
  bare cached forward.
* **Report** (``report``): a Markdown table, ``artifacts/bench.json`` and PNG plots of P99 against
  offered load and against prefix cap beside it.

Modes (``modes``): ``baseline`` (no pre-inference, no cache; ``rank_full``), ``relay``, and the
ablations ``relay_cache_only`` (no pre-inference), ``relay_no_dram``, ``relay_random_route``,
``relay_preinfer_all``.
"""
