"""Each word both sides speak is spelled once, in the core, and read from there (DESIGN, "Cache tiers":
outcomes, refusal reasons and miss reasons are enums in the core; the browser gets them from the
server). Read from the source, over every non-test file the product ships: Python (its string
literals, docstrings and f-strings included, not its identifiers), JavaScript and templates.

A word is the value of a member of one of ``VOCABULARIES``; its one spelling is in the module that
defines the enum. Elsewhere code names the member (``RefusalReason.CACHE_BUDGET``), and a page takes
values and labels from the server.
"""

from __future__ import annotations

import functools
import io
import re
import tokenize
from enum import Enum
from pathlib import Path

import pytest

from relay_engine.core.telemetry import MissReason, RefusalReason

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("relay_engine", "workers", "controlplane", "frontend")
WEB_SUFFIXES = (".js", ".html")
# Third-party bundles served as they come.
SKIP_PARTS = {"vendor", "node_modules", "__pycache__"}

# enum → the file that spells its values
VOCABULARIES: dict[type[Enum], str] = {
    RefusalReason: "relay_engine/core/telemetry.py",
    MissReason: "relay_engine/core/telemetry.py",
}
# Plain words of a vocabulary that another vocabulary of the product speaks too, and the files (or
# folders) where they are that other word: not counted there, counted everywhere else.
HOMONYMS: dict[type[Enum], dict[str, tuple[str, ...]]] = {
    MissReason: {
        "failed": ("controlplane/previews/",  # a preview's status
                   "frontend/static/frontend/config_preview.js",
                   "controlplane/rollouts/services.py"),  # the rollout pass's count of pools it could not do
        "unreadable": ("controlplane/telemetry/forwards.py",),  # forward windows that did not decode
    },
}


def _homonym_at(vocabulary: type[Enum], value: str, path: Path) -> bool:
    where = path.relative_to(ROOT).as_posix()
    return any(where.startswith(place) for place in HOMONYMS.get(vocabulary, {}).get(value, ()))


def _shipped_files() -> list[Path]:
    files = []
    for package in SHIPPED:
        for path in sorted((ROOT / package).rglob("*")):
            if path.suffix in (".py", *WEB_SUFFIXES) and not SKIP_PARTS & set(path.parts):
                files.append(path)
    return files


FILES = _shipped_files()


_QUOTES = re.compile(r"^[rbfuRBFU]*('''|\"\"\"|'|\")|('''|\"\"\"|'|\")$")  # a literal's prefix and quotes


def _word(value: str) -> re.Pattern:
    return re.compile(rf"(?<![\w-]){re.escape(value)}(?![\w-])")


@functools.cache  # every member of every vocabulary reads the same files: tokenize each once
def _string_bodies(text: str) -> tuple[tuple[int, str], ...]:
    """(line, body) of each string literal of Python source, f-strings included, prefix and quotes off."""
    return tuple((token.start[0], _QUOTES.sub("", token.string))
            for token in tokenize.generate_tokens(io.StringIO(text).readline) if token.type == tokenize.STRING)


def _python_spellings(text: str, value: str) -> list[int]:
    """Lines where a string literal of Python source spells ``value``: the whole string, or — for a
    word no English text uses (it has an underscore) — a word of it. Identifiers do not count."""
    word = _word(value)
    return [line for line, body in _string_bodies(text) if body == value or ("_" in value and word.search(body))]


def _spelled_at_home(text: str, member: Enum) -> bool:
    """The home spells the member's value, or composes it: a family of members made one per tier or
    per refusal is spelled once, by its f-string (``f"evicted_{tier}"``)."""
    if _python_spellings(text, member.value):
        return True
    family = getattr(member, "family", "")
    return bool(family) and member.value.startswith(f"{family}_") and any(
        body.startswith(f"{family}_{{") for _, body in _string_bodies(text))


def _web_spellings(text: str, value: str) -> list[int]:
    """Lines of a script or template that spell ``value``: quoted, or (a word with an underscore) at all."""
    pattern = _word(value) if "_" in value else re.compile(rf"([\"'`]){re.escape(value)}\1")
    return [text.count("\n", 0, m.start()) + 1 for m in pattern.finditer(text)]


def test_the_tree_has_files_to_read():
    suffixes = {path.suffix for path in FILES}
    assert {".py", ".js", ".html"} <= suffixes and len(FILES) > 100


@pytest.mark.parametrize("vocabulary", VOCABULARIES, ids=lambda v: v.__name__)
def test_each_word_is_spelled_only_where_its_enum_defines_it(vocabulary):
    home = ROOT / VOCABULARIES[vocabulary]
    assert home in FILES
    found = []
    for path in FILES:
        text = path.read_text(encoding="utf-8")
        for member in vocabulary:
            spell = _python_spellings if path.suffix == ".py" else _web_spellings
            if path == home:
                assert _spelled_at_home(text, member), \
                    f"{home.relative_to(ROOT)} no longer spells {member.value!r}: update VOCABULARIES"
                continue
            if _homonym_at(vocabulary, member.value, path):
                continue
            lines = spell(text, member.value)
            found += [f"{path.relative_to(ROOT)}:{line}: {member.value!r}" for line in lines]
    assert found == [], (f"{vocabulary.__name__} values spelled again (name the member, or take it from the "
                         f"server in a page):\n" + "\n".join(found))


@pytest.mark.parametrize("spelling", ['"inflight_limit"', "'inflight_limit'", '"x inflight_limit y"',
                                      'f"{n} cache_budget"', '"""doc: ``not_at_risk``"""'])
def test_a_second_spelling_in_python_is_found(spelling):
    value = next(v for v in ("inflight_limit", "cache_budget", "not_at_risk") if v in spelling)
    assert _python_spellings(f"x = 1\ny = {spelling}\n", value) == [2]


def test_identifiers_and_english_are_not_spellings():
    source = 'def decide(*, already_cached: bool):\n    return "the capture is disabled"\n'
    assert _python_spellings(source, "already_cached") == []
    assert _python_spellings(source, "disabled") == []
    assert _web_spellings("button.disabled = true;", "disabled") == []
    assert _web_spellings('const r = { inflight_limit: 1 };\nx("disabled")', "inflight_limit") == [1]
    assert _web_spellings('const r = { inflight_limit: 1 };\nx("disabled")', "disabled") == [2]
