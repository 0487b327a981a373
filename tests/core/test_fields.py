"""The core's field checks as the commands use them: a command-line number is judged like every other."""

from __future__ import annotations

import argparse

import pytest

from relay_engine.core import fields


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cmd")
    p.add_argument("--threads", type=fields.argument(1, 256, as_int=True), default=1)
    p.add_argument("--rate", type=fields.argument(0, 100_000), default=20.0)
    return p


def test_a_command_line_number_in_range_is_parsed_to_its_type():
    args = parser().parse_args(["--threads", "8", "--rate", "2.5"])
    assert (args.threads, args.rate) == (8, 2.5) and isinstance(args.threads, int)


@pytest.mark.parametrize(("argv", "message"), [
    (["--threads", "0"], "argument --threads: must be in [1, 256], got 0"),
    (["--threads", "1.5"], "argument --threads: must be an integer in [1, 256], got '1.5'"),
    (["--rate", "nan"], "argument --rate: must be finite, got nan"),
    (["--rate", "1e9"], "argument --rate: must be in [0, 100000], got 1000000000.0"),
])
def test_a_command_line_number_out_of_range_is_refused_saying_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(argv)
    assert message in capsys.readouterr().err


def test_json_value_names_what_is_not_json():
    assert fields.json_value(b'{"a": 1}', "record") == {"a": 1}
    with pytest.raises(fields.FieldValueError, match="^record is not JSON"):
        fields.json_value("[" * 100_000, "record")
    with pytest.raises(KeyError, match="record is not JSON"):
        fields.json_value(b"\xff", "record", KeyError)
