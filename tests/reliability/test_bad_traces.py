"""Malformed trace files: the replayer (and ``relay_engine.traffic check``) refuses them with an error
naming the line and the field, exit status 2, no traceback; nothing is sent."""

from __future__ import annotations

import pytest

from relay_engine.lab import traffic
from tests.reliability.figures import FIGURES
from workers import replay

GOOD = b'{"t_ms": 0, "user_id": "u1", "seq_len": 8, "short_len": 1, "n_candidates": 2, "rank_delay_ms": 5}'


def line(**overrides) -> bytes:
    fields = {"t_ms": "0", "user_id": '"u"', "seq_len": "8", "short_len": "1", "n_candidates": "2",
              "rank_delay_ms": "5"}
    fields.update(overrides)
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in fields.items() if v is not None) + "}").encode()


# (name, bad line, what the error must name)
BAD_LINES = [
    ("not JSON", b"t_ms,user_id,seq_len", "not valid JSON"),
    ("a JSON list", b"[0, 1, 2]", "JSON object"),
    ("null", b"null", "JSON object"),
    ("missing field", line(rank_delay_ms=None), "rank_delay_ms"),
    ("time as a string", line(t_ms='"soon"'), "t_ms"),
    ("NaN", line(t_ms="NaN"), "t_ms"),
    ("Infinity", line(rank_delay_ms="Infinity"), "rank_delay_ms"),
    ("overflowing float", line(t_ms="1e400"), "t_ms"),
    ("huge integer", line(seq_len="1" + "0" * 30), "seq_len"),
    ("5000-digit integer", line(seq_len="9" * 5000), "integer"),
    ("negative length", line(seq_len="-3"), "seq_len"),
    ("fractional length", line(n_candidates="2.5"), "n_candidates"),
    ("bool length", line(short_len="true"), "short_len"),
    ("too many candidates", line(n_candidates="100000000"), "n_candidates"),
    ("negative delay", line(rank_delay_ms="-1"), "rank_delay_ms"),
    ("user as an object", line(user_id='{"id": 1}'), "user_id"),
    ("empty user", line(user_id='""'), "user_id"),
    ("user too long", line(user_id='"' + "u" * 300 + '"'), "user_id"),
    ("not UTF-8", GOOD.replace(b'"u1"', b'"u\xff\xfe"'), "not UTF-8"),
    ("nested 100000 deep", b'{"t_ms": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("NUL bytes", b"\0\0\0\0", "not valid JSON"),
]


@pytest.mark.parametrize(("name", "bad", "names"), BAD_LINES, ids=[row[0] for row in BAD_LINES])
def test_replayer_refuses_a_malformed_trace_naming_line_and_field(tmp_path, capsys, name, bad, names):
    trace = tmp_path / "bad.jsonl"
    trace.write_bytes(GOOD + b"\n" + bad + b"\n" + GOOD + b"\n")
    FIGURES.hostile("trace lines", 2)
    assert replay.main(["--trace", str(trace), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and names in err and "Traceback" not in err
    assert traffic.main(["check", str(trace)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_a_missing_trace_file_is_a_clear_error(tmp_path, capsys):
    assert replay.main(["--trace", str(tmp_path / "nowhere.jsonl")]) == 2
    assert "nowhere.jsonl" in capsys.readouterr().err
