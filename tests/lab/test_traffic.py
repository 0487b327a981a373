"""Traces: seeded generation with the documented shape; malformed lines named by number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from relay_engine.core.features import SyntheticFeatures
from relay_engine.core.trace import TraceError, TraceQuery, read_trace, write_trace
from relay_engine.lab.traffic import TraceSpec, generate_trace
from tests.models import SMALL


def test_generation_is_reproducible_and_has_the_documented_shape(tmp_path):
    spec = TraceSpec(queries=3000, qps=100.0, seed=5)
    a, b = generate_trace(spec), generate_trace(spec)
    assert a == b
    lens = {}
    for q in a:
        assert lens.setdefault(q.user_id, q.seq_len) == q.seq_len  # one length per user
        assert 32 <= q.seq_len <= 8192 and q.short_len == 32 and q.n_candidates == 128
        assert 20 <= q.rank_delay_ms <= 60
    per_user = np.array(list(lens.values()))
    assert 350 < np.median(per_user) < 750
    span_s = (a[-1].t_ms - a[0].t_ms) / 1000
    assert 80 < len(a) / span_s < 120
    path = tmp_path / "t.jsonl"
    write_trace(path, a)
    assert read_trace(path) == a


@pytest.mark.parametrize(("line", "fragment"), [
    ("not json", "not valid JSON"),
    ('{"t_ms": 0, "user_id": "u", "seq_len": 10, "short_len": 1, "n_candidates": 1}', "rank_delay_ms"),
    ('{"t_ms": 0, "user_id": "u", "seq_len": -3, "short_len": 1, "n_candidates": 1, "rank_delay_ms": 1}',
     "seq_len"),
    ('{"t_ms": "x", "user_id": "u", "seq_len": 3, "short_len": 1, "n_candidates": 1, "rank_delay_ms": 1}', "t_ms"),
    ('[1, 2]', "JSON object"),
    ('{"t_ms": 0, "user_id": "u", "seq_len": 3, "short_len": 1, "n_candidates": 1, "rank_delay_ms": 1, '
     '"instance": 7}', "instance"),
])
def test_a_malformed_line_is_named_by_its_number(tmp_path, line, fragment):
    good = '{"t_ms": 0, "user_id": "u", "seq_len": 10, "short_len": 1, "n_candidates": 1, "rank_delay_ms": 5}'
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + good + "\n" + line + "\n")
    with pytest.raises(TraceError, match="line 3") as info:
        read_trace(path)
    assert fragment in str(info.value)


def test_unknown_fields_are_ignored(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t_ms": 1, "user_id": 7, "seq_len": 10, "short_len": 1, "n_candidates": 2, '
                    '"rank_delay_ms": 5, "region": "eu"}\n')
    (q,) = read_trace(path)
    assert q.user_id == "7" and q.n_candidates == 2


def test_the_serving_instance_round_trips_and_a_trace_without_it_reads_as_unknown(tmp_path):
    path = tmp_path / "t.jsonl"
    served = TraceQuery(1.0, "u", 10, 1, 2, 5.0, instance="main.1")
    plain = TraceQuery(2.0, "v", 10, 1, 2, 5.0)
    write_trace(path, [served, plain])
    assert '"instance"' not in path.read_text().splitlines()[1]  # traces without it are written as before
    assert read_trace(path) == [served, plain] and read_trace(path)[1].instance == ""


def test_features_are_deterministic_per_user_and_length():
    f = SyntheticFeatures(SMALL, with_timestamps=True)
    assert f.prefix("u1", 50).digest() == f.prefix("u1", 50).digest()
    assert f.prefix("u1", 50).digest() != f.prefix("u2", 50).digest()
    assert f.prefix("u1", 50).digest() != f.prefix("u1", 51).digest()
    assert not torch.equal(f.short_term("u1", 0, 8).items, f.short_term("u1", 1, 8).items)
    p, s = f.prefix("u1", 50), f.short_term("u1", 3, 8)
    assert int(p.timestamps.max()) < int(s.timestamps.min())
