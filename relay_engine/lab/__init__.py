"""The lab: benchmark, fleet simulator, profile, trace generation, synthetic worlds, editing workflow.

Run from a terminal through the commands beside it (``python -m relay_engine.bench`` …). It uses the
core's public API only; nothing but the command line and the tests imports it.
"""
