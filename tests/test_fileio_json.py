"""`fileio.loads_json`: strict JSON from files anyone may have written. A key twice, NaN or
Infinity, text that is not UTF-8 and nesting past 64 levels are one-line input errors naming the
file (exit 2), never a traceback, however deep the nesting."""

from __future__ import annotations

import pytest

from shardplan.errors import EXIT_BAD_INPUT, InputFileError
from shardplan.fileio import MAX_JSON_NESTING_DEPTH, loads_json


def _error(text: str | bytes) -> str:
    with pytest.raises(InputFileError) as e:
        loads_json(text, label="x.json", what="the file", field="header", hint="fix it")
    assert e.value.exit_code == EXIT_BAD_INPUT
    line = e.value.one_line()
    assert "\n" not in line and line.startswith("x.json: field 'header': ") and line.endswith("(fix: fix it)")
    return line


def test_plain_json_is_read_as_json():
    assert loads_json(b'{"a": [1, 2.5, {"b": null}], "c": "d"}', label="x", hint="h") == \
        {"a": [1, 2.5, {"b": None}], "c": "d"}


def test_a_key_twice_is_refused_at_any_depth():
    assert "holds the key 'a' twice in one object" in _error('{"a": 1, "b": 2, "a": 3}')
    assert "holds the key 'k' twice" in _error('{"x": [{"k": 1, "k": 1}]}')
    assert loads_json('{"a": {"k": 1}, "b": {"k": 2}}', label="x", hint="h") == {"a": {"k": 1}, "b": {"k": 2}}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_refused(constant):
    assert f"holds {constant}" in _error(f'{{"a": {constant}}}')


def test_nesting_is_bounded_without_recursion():
    ok = "[" * MAX_JSON_NESTING_DEPTH + "]" * MAX_JSON_NESTING_DEPTH
    assert loads_json(ok, label="x", hint="h") is not None
    assert "nested more than 64 levels deep" in _error("[" * 65 + "]" * 65)
    assert "nested more than 64 levels deep" in _error('{"a": ' * 65 + "1" + "}" * 65)
    # past the parser's own recursion limit too: a one-line error, not a RecursionError
    assert "nested more than 64 levels deep" in _error('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_not_utf8_and_not_json():
    assert "not UTF-8 text (byte 7)" in _error(b'{"a": "\xff"}')
    assert "is not JSON: line 1 column 2" in _error("{x}")
