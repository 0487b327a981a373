"""Pre-inference yields to ranking inside a layer: a rank that arrives while a prefill's layer is
under way is served before that layer's attention (the longest step) runs. An ordering property,
not a timing one."""

from __future__ import annotations

import threading

import pytest

from relay_engine.core.config import parse_policy
from relay_engine.core.engine import PreInferRequest, RankRequest, RelayEngine
from relay_engine.core.model import module as model_module
from tests.models import SMALL, make_history

SHORT = make_history(8, SMALL, seed=100)


class _RankOnFirstYield:
    """The model's forwards; at the prefill's first yield point (inside its first layer) a rank
    starts on another thread, and the prefill goes on only through the engine's pacer."""

    def __init__(self, engine_model, engine_box, events):
        self.model, self.engine_box, self.events = engine_model, engine_box, events
        self.ranked = threading.Thread()

    def prefill(self, prefix, edit=None, *, between_layers=None):
        first = [True]

        def yield_point():
            if first[0]:
                first[0] = False
                self.events.append("yield inside layer 0")
                engine = self.engine_box[0]
                self.ranked = threading.Thread(target=lambda: engine.rank(
                    RankRequest("ranker", make_history(50, SMALL, seed=7), SHORT, list(range(10)))))
                self.ranked.start()
                while not engine.ranking_gate.active and self.ranked.is_alive():
                    threading.Event().wait(0.001)
            between_layers()

        return self.model.prefill(prefix, edit, between_layers=yield_point)

    def rank_full_keeping_prefix(self, *args, **kwargs):
        result = self.model.rank_full_keeping_prefix(*args, **kwargs)
        self.events.append("rank scored")
        return result

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.fixture
def attention_events(monkeypatch):
    events: list[str] = []
    kernel_of = model_module.attention_kernel

    def recording_kernel(device):
        kernel = kernel_of(device)

        def attend(q, *args, **kwargs):
            if q.shape[1] > 100:  # the prefill's (300 rows), not the rank's
                events.append("prefill attention")
            out = kernel(q, *args, **kwargs)
            if q.shape[1] > 100:
                events.append("prefill attention done")
            return out

        return attend

    monkeypatch.setattr(model_module, "attention_kernel", recording_kernel)
    return events


def test_a_rank_arriving_mid_layer_is_served_before_the_prefills_attention(attention_events):
    events = attention_events
    # A share so small that any compute is beyond it: the prefill pauses until ranking ends.
    policy = parse_policy({"trigger": {"at_risk_seq_len": 100, "preinfer_compute_share": 1e-6}})
    model = RelayEngine(SMALL, device="cpu", policy=policy).model
    box: list[RelayEngine] = []
    forwards = _RankOnFirstYield(model, box, events)
    engine = RelayEngine(model=model, device="cpu", policy=policy, forwards=forwards)
    box.append(engine)
    try:
        assert engine.pre_infer(PreInferRequest("prefilled", make_history(300, SMALL, seed=3))).admitted
    finally:
        forwards.ranked.join(30)
    assert events[:3] == ["yield inside layer 0", "rank scored", "prefill attention"], events
    assert events.count("prefill attention") == SMALL.num_layers


def test_a_long_prefill_also_yields_between_its_attentions_tile_steps(attention_events):
    events = attention_events
    model = RelayEngine(SMALL, device="cpu").model
    model.prefill(make_history(300, SMALL, seed=4), between_layers=lambda: events.append("yield"))
    # 300 rows are several tiles (SMALL's block_rows): a step per diagonal, a yield between two, in every layer
    for layer in range(SMALL.num_layers):
        start = [i for i, e in enumerate(events) if e == "prefill attention"][layer]
        end = events.index("prefill attention done", start)
        inside = events[start + 1:end]
        assert len(inside) >= 2 and set(inside) == {"yield"}, events
