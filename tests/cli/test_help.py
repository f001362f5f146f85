"""`--help` and the README print the one list of exit codes in errors.py; `-h` is `--help`;
shell completion is offered."""

from __future__ import annotations

import re

from conftest import REPO

from shardplan.errors import EXIT_CODES


def _readme_exit_codes() -> dict[int, str]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    return {int(code): meaning for code, meaning in re.findall(r"^\| (\d+) \| (.+) \|$", section, re.M)}


def test_help_lists_every_exit_code_of_errors_py(cli):
    out = cli("--help").stdout
    flat = " ".join(out.split())  # rich wraps lines; compare words
    for code, meaning in EXIT_CODES.items():
        assert f"{code} {' '.join(meaning.split())}" in flat.replace("│", " ").replace("  ", " "), code
    assert set(EXIT_CODES) == {0, 1, 2, 3, 4, 5}


def test_readme_documents_exactly_the_exit_codes_of_errors_py():
    assert set(_readme_exit_codes()) == set(EXIT_CODES)


def test_dash_h_is_help_everywhere(cli):
    for args in ([], ["estimate"], ["models"], ["hardware", "show"], ["export"]):
        short, long = cli(*args, "-h"), cli(*args, "--help")
        assert short.exit_code == long.exit_code == 0, args
        assert short.stdout == long.stdout and "Usage:" in short.stdout, args


def test_shell_completion_is_offered(cli):
    out = cli("--help").stdout
    assert "--install-completion" in out and "--show-completion" in out


def test_the_request_length_defaults_are_stated_on_every_serving_command(cli):
    """Their defaults are resolved per model (a short context gets shorter requests), so `--help` says
    them in words; rich markup would drop them if they were written in square brackets."""
    for command in ("estimate", "recommend", "capacity"):
        flat = " ".join(cli(command, "--help").stdout.replace("│", " ").split())
        assert "(default: 1024; with --output-len left out too" in flat, command
        assert "(default: 128, or an eighth of a shorter context)" in flat, command
