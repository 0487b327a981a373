"""The benchmark: how much longer a sequence and how much more SLO-compliant throughput relay-race
inference sustains than full inference at ranking, on the same trace and hardware in one run.

    python -m relay_engine.bench [--trace FILE] [--slo-ms 50] [--instances N] [--out FILE] [--quick]

N engine instances run as separate processes, each with its share of the machine's cores
(``torch.set_num_threads(cores // N)``) and the same seeded weights. The driver replays the trace
open-loop: arrivals at the trace's times scaled to the offered QPS (``rank_delay_ms`` is a property
of the cascade and is not scaled); each ranking latency is measured from the request's scheduled
arrival, so queueing counts. A ranking request carries a deadline (``--deadline-ms`` after its
arrival) and fails fast once past it; it is counted, never dropped. Pre-inference runs on its own
threads inside the instance, on the same cores as ranking, at a lower scheduling priority (nice
+10): ranking is latency-critical, pre-inference is best effort (on an accelerator, a low-priority
stream plays that part).

Modes: ``baseline`` (no pre-inference; ranking runs ``rank_full``), ``relay`` (trigger + affinity
router + HBM tier + DRAM expander) and the ablations ``relay_no_dram`` (DRAM budget 0),
``relay_random_route`` (pre-infer signal and ranking routed independently at random) and
``relay_preinfer_all`` (the trigger admits every length; budgets still apply).

For each mode, two sweeps by bisection over fixed grids:

* **max sequence length at SLO**: the longest prefix cap (prefixes truncated to their most recent
  ``cap`` tokens) at which ranking P99 ≤ SLO at the reference QPS;
* **SLO-compliant throughput**: the highest offered QPS whose ranking P99 ≤ SLO, every mode at the
  same cap — the baseline's max sequence length — so all compare on equal model input. Its first
  probe, at the reference QPS, is the *reference load* whose figures (P50/P99/P999, hit rates,
  pre-infer admissions and refusals by reason, peak cache bytes against budget, missed deadlines)
  the report shows.

Every mode starts from fresh instances at the start of the trace and walks through it: each probe
replays the next window of queries, a short unmeasured warm-up then the measured part, and caches
persist from one probe to the next, as in a fleet serving traffic (the relay modes also get one
unmeasured warm-up window first). A probe stops early once more than 1 % of its measured requests
have broken the SLO (its P99 is then over the SLO whatever follows).

A second figure from the same run: ``rank`` through the engine (cache lookup, key digest, trigger,
accounting) against the bare cached forward of the same model, as a ratio.
"""
