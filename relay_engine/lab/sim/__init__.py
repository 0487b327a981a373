"""The calibrated fleet simulator: the real trigger, router, HBM/DRAM tiers and engine policy code on
a virtual clock, with forward passes replaced by a cost model fitted to measured profiles.

* ``des`` — the virtual clock, processes (greenlets) and each instance's shared compute (weighted
  processor sharing: ranking and the pre-inference lane at its compute share);
* ``virtual`` — the engine's seams on that clock: ``CostForwards`` (``engine.Forwards`` from a
  ``costmodel.CostModel``), a sizeless KV, the lane, and the waiter for computations in flight;
* ``fleet`` — N ``RelayEngine`` instances (or the baseline) replaying the benchmark's events,
  routed by the real ``AffinityRouter``; ``simulate_point`` is the benchmark's point, simulated;
* ``preview`` — a whole trace through the fleet, and ``preview(queries, spec, instances, cost)``:
  the figures of one policy on one traffic window (the what-if preview runs it for two specs);
* ``validate`` — the simulator against the real fleet on the same points and windows;
* ``cli`` — ``python -m relay_engine.sim run | project | validate | preview``.
"""
