"""RelayGR's engine, in two rooms.

* ``relay_engine.core`` — what a worker loads (stdlib, numpy, torch only): the model, the HBM and
  DRAM tiers, the trigger, the router, the engine, the policy schema, the wire contract, telemetry
  types, trace format and features.
* ``relay_engine.lab`` — what people run at a terminal: the benchmark, the fleet simulator, the
  profile, trace generation, synthetic worlds and the editing workflow. The lab imports the core's
  public API; the core never imports the lab, and neither do ``workers``, ``controlplane`` or
  ``frontend``.

The commands are thin entry points beside the two rooms: ``python -m relay_engine.bench``,
``relay_engine.editing``, ``relay_engine.profile``, ``relay_engine.traffic``.
"""
